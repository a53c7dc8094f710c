"""One tensor of a Hugging Face model and the logical tensors of ours it is made of."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HFTensor:
    """`name` in the HF checkpoint holds our logical tensors `parts` (checkpoint keys without
    "model/") stacked along dim 0, transposed for GPT-2's Conv1D layers ([in, out])."""

    name: str
    parts: tuple[str, ...]
    transpose: bool = False
    shift: float = 0.0  # HF value = ours + shift (norm weights stored centred on zero)
