"""One tensor of a Hugging Face model and the logical tensors of ours it is made of."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# How fused experts are stored (GptOssForCausalLM): `parts` are the experts' tensors in expert
# order (gate and up of expert 0, then of expert 1, ... for the gate_up layouts).
EXPERT_LAYOUTS = ("experts_gate_up", "experts_gate_up_bias", "experts_down", "experts_stack")


@dataclass(frozen=True)
class HFTensor:
    """`name` in the HF checkpoint holds our logical tensors `parts` (checkpoint keys without
    "model/") stacked along dim 0, transposed for GPT-2's Conv1D layers ([in, out]); or, with
    one of EXPERT_LAYOUTS, the experts' tensors packed as that layout says (`pack`)."""

    name: str
    parts: tuple[str, ...]
    transpose: bool = False
    shift: float = 0.0  # HF value = ours + shift (norm weights stored centred on zero)
    layout: str | None = None  # one of EXPERT_LAYOUTS, or None: stacked rows
    copy: bool = False  # another HF tensor holds the same of ours: written, never read


def pack(layout: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The HF tensor of the experts' `parts`:

    - experts_gate_up: gate [f, h] and up [f, h] per expert -> [E, h, 2f], the gate's columns at
      even places and the up's at odd ones (transformers' GptOssExperts.gate_up_proj);
    - experts_gate_up_bias: gate [f] and up [f] per expert -> [E, 2f], interleaved alike;
    - experts_down: the down projection [h, f] per expert -> [E, f, h] (transposed);
    - experts_stack: [n] per expert -> [E, n]."""
    if layout in ("experts_gate_up", "experts_gate_up_bias"):
        gates, ups = parts[0::2], parts[1::2]
        pairs = [torch.stack([g, u], dim=-1) for g, u in zip(gates, ups, strict=True)]
        if layout == "experts_gate_up":  # [f, h, 2] -> [h, f, 2] -> [h, 2f]
            return torch.stack([p.transpose(0, 1).reshape(p.shape[1], -1) for p in pairs])
        return torch.stack([p.reshape(-1) for p in pairs])
    if layout == "experts_down":
        return torch.stack([p.t() for p in parts])
    if layout == "experts_stack":
        return torch.stack(parts)
    raise ValueError(f"unknown expert layout {layout!r}")


def unpack(layout: str, value: torch.Tensor) -> list[torch.Tensor]:
    """`pack`'s parts back from the HF tensor."""
    if layout in ("experts_gate_up", "experts_gate_up_bias"):
        out = []
        for expert in value:
            if layout == "experts_gate_up":  # [h, 2f] -> gate, up [f, h]
                out += [expert[:, 0::2].t(), expert[:, 1::2].t()]
            else:
                out += [expert[0::2], expert[1::2]]
        return out
    if layout == "experts_down":
        return [expert.t() for expert in value]
    if layout == "experts_stack":
        return list(value)
    raise ValueError(f"unknown expert layout {layout!r}")


def packed_shape(layout: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The HF tensor's shape for parts of these shapes."""
    if layout == "experts_gate_up":
        f, h = shapes[0]
        return (len(shapes) // 2, h, 2 * f)
    if layout == "experts_gate_up_bias":
        return (len(shapes) // 2, 2 * shapes[0][0])
    if layout == "experts_down":
        h, f = shapes[0]
        return (len(shapes), f, h)
    return (len(shapes), *shapes[0])
