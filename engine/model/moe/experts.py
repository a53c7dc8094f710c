"""The routed experts of one MoE layer: expert e is an MLP (engine/model/mlp.py) whose weights
are the global parameters layers.N.mlp.experts.local_experts.<e>.linear_fc1/2 (megatron-core's
names, by the expert's global index), so a checkpoint keeps each expert by its index.

`forward` takes the tokens grouped by expert (expert 0's first, `counts` per expert) with their
router probabilities and returns each token's expert output scaled by its probability. Each
expert runs on its own tokens; with --moe-grouped-gemm, where torch has a grouped GEMM for the
device and shapes (`torch._grouped_mm`: 16-byte aligned rows, no biases, the GELU or SwiGLU
of the dense MLP), the experts' up and down projections each run as one grouped GEMM instead,
on the same weights; elsewhere (biases, squared ReLU, other dtypes or devices, unaligned rows)
as one batched GEMM each (`torch.bmm`) over the experts' rows padded to the busiest expert's,
where that padding at most doubles the rows (else the loop). With FP8 (engine/ops/fp8/apply.py)
each expert runs its own FP8 GEMMs (its linears' own scales); with --moe-grouped-gemm, no
biases and no tensor parallelism within an expert, each projection of all experts is one
autograd function whose forward products are one FP8 grouped GEMM where the device has it
(`torch._scaled_grouped_mm`, CUDA: engine/ops/fp8/grouped.py), each expert's in turn elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.context import BuildContext
from engine.model.mlp import MLP
from engine.ops.fp8.grouped import grouped_fp8_fits, grouped_fp8_linear
from parallel.expert_parallel.params import mark_expert_parallel
from parallel.random import checkpoint


class Experts(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int, expert_indices: range, path: str):
        """path: the layer's place in the model (its experts' checkpoint names go under it)."""
        super().__init__()
        cfg = ctx.config
        self.cfg = cfg
        self.expert_indices = expert_indices
        seeds = f"layers.{layer_number}.mlp.experts.local_experts"
        self.local_experts = nn.ModuleList(
            MLP(ctx, layer_number, f"{seeds}.{e}", cfg.expert_ffn_size) for e in expert_indices
        )
        prefix = f"{path}.mlp.experts.local_experts"
        # the grouped GEMM reads the experts' weights without calling them: data parallelism
        # waits for their gathers before this module's forward (parallel/data_parallel/ddp.py)
        self.reads_child_parameters = True
        # (--moe-grouped-gemm's paths; inside a rerun MoE layer the activation reruns with it)
        modules = cfg.selective_modules
        self.recompute_activation = "moe_act" in modules and "moe" not in modules
        self.tracker = ctx.tracker
        for expert, index in zip(self.local_experts, expert_indices, strict=False):
            for name, param in expert.named_parameters():
                param.checkpoint_name = f"{prefix}.{index}.{name}"  # the global index
                mark_expert_parallel(param)  # reduced over the expert data-parallel group

    def forward(self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        in_fp8 = self.local_experts[0].linear_fc1.fp8 is not None
        if self.cfg.moe_grouped_gemm and in_fp8 and self._fp8_groups_fit():
            return self._fp8_grouped(tokens, counts, probs)
        if self.cfg.moe_grouped_gemm and not in_fp8 and grouped_gemm_fits(self, tokens):
            return self._grouped(tokens, counts, probs)
        if self.cfg.moe_grouped_gemm and not in_fp8 and _padding_bounded(counts):
            return self._batched(tokens, counts, probs)
        outputs = []
        for expert, part, p in zip(
            self.local_experts, tokens.split(counts), probs.split(counts), strict=False
        ):
            outputs.append(expert(part, p))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, tokens.shape[-1])

    def _fp8_groups_fit(self) -> bool:
        experts = self.local_experts
        linears = [e.linear_fc1 for e in experts] + [e.linear_fc2 for e in experts]
        return grouped_fp8_fits(linears)

    def _fp8_grouped(self, tokens, counts, probs) -> torch.Tensor:
        """FP8 with --moe-grouped-gemm: each projection of every expert as one autograd
        function (engine/ops/fp8/grouped.py), each expert's GEMMs with its own scales."""
        h = grouped_fp8_linear(tokens, counts, [e.linear_fc1 for e in self.local_experts])
        h = self._activate(h)
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        return grouped_fp8_linear(h, counts, [e.linear_fc2 for e in self.local_experts])

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        activate = self.local_experts[0].activate
        if self.recompute_activation and self.training:
            return checkpoint(activate, self.tracker, h)  # rerun in backward, not kept
        return activate(h)

    def _batched(self, tokens, counts, probs) -> torch.Tensor:
        """The experts as one batched GEMM per projection: expert e's rows in row e of an
        [E, busiest, h] block (zeros after its own), weights stacked [E, out, in]."""
        device, experts = tokens.device, self.local_experts
        sizes = torch.tensor(counts, device=device)
        width = max(counts)
        expert_of = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        slot = expert_of * width + torch.arange(tokens.shape[0], device=device) - starts[expert_of]
        padded = tokens.new_zeros(len(counts) * width, tokens.shape[-1])
        padded = padded.index_copy(0, slot, tokens).view(len(counts), width, -1)
        fc1 = torch.stack([e.linear_fc1.weight for e in experts])
        h = torch.bmm(padded, fc1.transpose(1, 2))
        if experts[0].linear_fc1.bias is not None:
            h = h + torch.stack([e.linear_fc1.bias for e in experts]).unsqueeze(1)
        h = self._activate(h)
        scale = probs.new_zeros(len(counts) * width).index_copy(0, slot, probs)
        scale = scale.view(len(counts), width, 1)
        h = (h * scale).to(h.dtype)
        fc2 = torch.stack([e.linear_fc2.weight for e in experts])
        out = torch.bmm(h, fc2.transpose(1, 2))
        if experts[0].linear_fc2.bias is not None:
            bias = torch.stack([e.linear_fc2.bias for e in experts]).unsqueeze(1)
            out = (out + bias * scale).to(out.dtype)
        return out.reshape(-1, out.shape[-1]).index_select(0, slot)

    def _grouped(self, tokens, counts, probs) -> torch.Tensor:
        ends = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight.t() for e in self.local_experts])
        h = self._activate(torch._grouped_mm(tokens, fc1, offs=ends))
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        fc2 = torch.stack([e.linear_fc2.weight.t() for e in self.local_experts])
        return torch._grouped_mm(h, fc2, offs=ends)


def _padding_bounded(counts: list[int]) -> bool:
    """Whether padding every expert's rows to the busiest expert's at most doubles them (the
    batched path's memory); skewed routing runs the loop instead."""
    rows = sum(counts)
    return rows > 0 and len(counts) * max(counts) <= 2 * rows


def grouped_gemm_fits(experts: Experts, tokens: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these experts on this device: CUDA in bf16 or the
    CPU in fp32/bf16, rows of 16-byte multiples, no biases, GELU or SwiGLU."""
    if not hasattr(torch, "_grouped_mm") or not tokens.is_contiguous():
        return False
    allowed = (torch.bfloat16,) if tokens.device.type == "cuda" else (torch.float32, torch.bfloat16)
    if tokens.dtype not in allowed or tokens.device.type not in ("cuda", "cpu"):
        return False
    first = experts.local_experts[0]
    if first.squared_relu or first.linear_fc1.bias is not None:
        return False
    size = tokens.element_size()
    widths = (first.linear_fc1.weight.shape[0], first.linear_fc2.weight.shape[0], tokens.shape[1])
    return (
        all(width * size % 16 == 0 for width in widths)
        and first.linear_fc2.weight.shape[1] * size % 16 == 0
    )
