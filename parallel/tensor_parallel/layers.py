"""Tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding and a
vocab-parallel cross-entropy that never gathers the full-vocabulary logits.

Initialisation draws only this rank's slice of each weight, on its device, from a seed that
belongs to the parameter (not to the rank) and each element's position in the full weight
(parallel/tensor_parallel/init.py), so every TP size starts from the same model. Activations
are [sequence, batch, hidden]; with sequence parallelism (SP) the sequence dimension of the
tensors between TP blocks is split over the TP group. Layers built with a `times`
(parallel.timing.StepTimes) count their TP communication as "tp-comm".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.comm import all_reduce, group_rank, group_size
from parallel.errors import ConfigError
from parallel.tensor_parallel.init import InitMethod, draw_local
from parallel.tensor_parallel.linear_function import tensor_parallel_linear
from parallel.tensor_parallel.regions import (
    gather_from_tensor_parallel_region,
    measure_tp_comm,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from parallel.tensor_parallel.sharding import (
    REPLICATED,
    has_tp_partial_grad,
    mark_tp_partial_grad,
    set_tp_sharding,
    split_sharding,
)
from parallel.timing import StepTimes


def _param(tensor: torch.Tensor, device, dtype) -> nn.Parameter:
    return nn.Parameter(tensor.to(device=device, dtype=dtype))


def _drawn_param(shape, sharding, init: InitMethod, seed: int, device, dtype, rows=None):
    """This rank's slice of a weight drawn in place (parallel/tensor_parallel/init.py), as a
    parameter that knows its sharding; rows from `rows` on start at zero."""
    param = _param(draw_local(shape, sharding, init, seed, device, rows), device, dtype)
    set_tp_sharding(param, sharding)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows over the TP group.

    partition_sizes stacks several logical outputs (e.g. q, k, v) that are split separately,
    so rank r holds [q_r; k_r; v_r]; the local output is in that order. With sequence_parallel
    the [s/tp, b, h] input is all-gathered along the sequence first (and only the shard is kept
    for backward). The input-gradient communication overlaps the weight-gradient GEMM, and with
    gradient_accumulation_fusion the weight gradient goes straight into `main_grad` (see
    parallel/tensor_parallel/linear_function.py). With `communicate=False` the layer only
    multiplies by its shard: its caller gathers the input and sums the input gradient (an MoE
    expert under expert tensor parallelism).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group,
        init_method: InitMethod,
        init_seed: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_sizes: list[int] | None = None,
        partition_names: list[str] | None = None,
        initialized_rows: int | None = None,
        gradient_accumulation_fusion: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        times: StepTimes | None = None,
        communicate: bool = True,
    ):
        """initialized_rows: only the first rows are drawn, the rest start at zero (an output
        layer over a padded vocabulary, whose padding must not depend on the TP size)."""
        super().__init__()
        self.tp_group, self.times, self.communicate = tp_group, times, communicate
        self.fp8 = None  # engine/ops/fp8/apply.py's Fp8Linear: the GEMMs in FP8
        tp, rank = group_size(tp_group), group_rank(tp_group)
        sizes = list(partition_sizes or [output_size])
        if sum(sizes) != output_size:
            raise ValueError(f"partition sizes {sizes} do not add up to {output_size}")
        for size in sizes:
            if size % tp:
                raise ConfigError(f"output size {size} is not divisible by TP size {tp}")
        if gather_output and len(sizes) > 1:
            raise ValueError("gather_output needs a single partition")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.output_size_per_partition = output_size // tp
        sharding = split_sharding(0, sizes, rank, tp, partition_names)
        rows = output_size if initialized_rows is None else initialized_rows
        self.weight = _drawn_param(
            (output_size, input_size), sharding, init_method, init_seed, device, params_dtype, rows
        )
        if rows != output_size:
            self.weight.real_rows = rows  # rows past it are padding, not part of the model
        if bias:
            self.bias = _param(torch.zeros(self.output_size_per_partition), device, params_dtype)
            set_tp_sharding(self.bias, sharding)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tensor_parallel_linear(
            x,
            self.weight,
            self.bias,
            self.tp_group,
            "none" if not self.communicate else "gather" if self.sequence_parallel else "copy",
            self.gradient_accumulation_fusion,
            self.times,
            self.fp8,
        )
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group, self.times)
        return y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns; the partial products are summed over the
    TP group (all-reduce, or reduce-scatter along the sequence with sequence_parallel). The
    bias is added once, after the reduction. With `communicate=False` the partial products are
    returned unsummed, for the caller to sum (an MoE expert under expert tensor parallelism;
    no bias then)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group,
        init_method: InitMethod,
        init_seed: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        gradient_accumulation_fusion: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        times: StepTimes | None = None,
        communicate: bool = True,
    ):
        super().__init__()
        self.tp_group, self.times, self.communicate = tp_group, times, communicate
        self.fp8 = None  # engine/ops/fp8/apply.py's Fp8Linear: the GEMMs in FP8
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if not communicate and bias and tp > 1:
            raise ValueError("a row-parallel linear summed by its caller takes no bias")
        if input_size % tp:
            raise ConfigError(f"input size {input_size} is not divisible by TP size {tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        sharding = split_sharding(1, [input_size], rank, tp)
        self.weight = _drawn_param(
            (output_size, input_size), sharding, init_method, init_seed, device, params_dtype
        )
        if bias:
            self.bias = _param(torch.zeros(output_size), device, params_dtype)
            set_tp_sharding(self.bias, REPLICATED)
            if self.sequence_parallel:
                mark_tp_partial_grad(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, bias_scale: torch.Tensor | None = None) -> torch.Tensor:
        """`bias_scale` [tokens, 1]: the bias is added times it (an MoE expert's output is
        scaled by the token's router probability, its bias too)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group, self.times)
        y = tensor_parallel_linear(
            x, self.weight, None, self.tp_group, "none", self.gradient_accumulation_fusion,
            fp8=self.fp8,
        )  # fmt: skip
        if not self.communicate:
            pass  # partial products: the caller sums them
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group, self.times)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group, self.times)
        if self.bias is not None and bias_scale is not None:
            y = (y + self.bias * bias_scale).to(y.dtype)
        elif self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns and the
    results are summed over the TP group (reduce-scattered along the sequence with SP).

    Input ids are [s, b]; output is [s, b, h] ([s/tp, b, h] with sequence_parallel). Rows from
    `vocab_size` up to the padded size start (and stay) zero.
    """

    def __init__(
        self,
        padded_vocab_size: int,
        embedding_dim: int,
        *,
        tp_group,
        init_method: InitMethod,
        init_seed: int,
        vocab_size: int | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        times: StepTimes | None = None,
    ):
        super().__init__()
        self.tp_group, self.times = tp_group, times
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if padded_vocab_size % tp:
            raise ConfigError(f"padded vocabulary {padded_vocab_size} is not divisible by TP {tp}")
        vocab_size = vocab_size or padded_vocab_size
        self.sequence_parallel = sequence_parallel and tp > 1
        self.per_partition = padded_vocab_size // tp
        self.vocab_start = rank * self.per_partition
        self.vocab_end = self.vocab_start + self.per_partition
        sharding = split_sharding(0, [padded_vocab_size], rank, tp)
        self.weight = _drawn_param(
            (padded_vocab_size, embedding_dim), sharding, init_method, init_seed, device,
            params_dtype, vocab_size,
        )  # fmt: skip
        if vocab_size != padded_vocab_size:
            self.weight.real_rows = vocab_size  # rows past it are padding, not part of the model

    def forward(self, ids: torch.Tensor, tied_output: str | None = None) -> torch.Tensor:
        """Embeddings of ids [s, b]. With tied_output ("copy", or "gather" under SP; see
        parallel/tensor_parallel/linear_function.py) the table serves as the tied output layer
        instead: the input is the final hidden states and the result their logits over this rank's
        vocabulary rows. That goes through the module call too, so hooks on the module (the
        parameter gather of --overlap-param-gather) run before the table is read."""
        if tied_output is not None:
            return tensor_parallel_linear(
                ids, self.weight, None, self.tp_group, tied_output, times=self.times
            )
        if self.tp_group is None:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group, self.times)
        return reduce_from_tensor_parallel_region(out, self.tp_group, self.times)


CE_CHUNK = 1 << 24  # logits elements per fp32 piece of the cross-entropy


def _ce_rows(logits: torch.Tensor) -> list[slice]:
    """Row ranges of the flattened [tokens, V/tp] logits that hold about CE_CHUNK elements."""
    tokens = logits.shape[0]
    step = max(1, CE_CHUNK // max(1, logits.shape[1]))
    return [slice(start, start + step) for start in range(0, tokens, step)]


def _shifted(logits, rows, vocab_start, vocab_size, row_max=None) -> torch.Tensor:
    """A piece of the logits in fp32, padding columns at -inf, minus its rows' max."""
    piece = logits[rows].float()
    local_vocab = logits.shape[-1]
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
        piece = piece.masked_fill(ids >= vocab_size, float("-inf"))  # padding rows
    # out of place: for fp32 logits without padding, `piece` is a view of the input
    return piece if row_max is None else piece - row_max[rows].unsqueeze(-1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """fp32 statistics over logits of any dtype, a piece of CE_CHUNK elements at a time: the
    logits are saved as they are (no fp32 copy or softmax kept for backward, which recomputes
    the softmax piece by piece), and each statistic crosses the TP group once."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, times):
        shape = target.shape
        flat, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        local_vocab = flat.shape[-1]
        pieces = _ce_rows(flat)
        row_max = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        for rows in pieces:
            row_max[rows] = _shifted(flat, rows, vocab_start, vocab_size).max(dim=-1).values
        with measure_tp_comm(times, group):
            all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = torch.empty_like(row_max)
        sum_exp = torch.empty_like(row_max)
        for rows in pieces:
            piece = _shifted(flat, rows, vocab_start, vocab_size, row_max)
            predicted[rows] = piece.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
            sum_exp[rows] = piece.exp_().sum(dim=-1)
        predicted.masked_fill_(outside, 0.0)
        with measure_tp_comm(times, group):
            all_reduce(predicted, group)
            all_reduce(sum_exp, group)
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted
        ctx.save_for_backward(logits, row_max, sum_exp, outside, local_target)
        ctx.vocab_start, ctx.vocab_size = vocab_start, vocab_size
        return loss.view(shape), (log_sum_exp + row_max).view(shape)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        # d loss / d logits = softmax - onehot(target); d logsumexp / d logits = softmax.
        logits, row_max, sum_exp, outside, local_target = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad_loss = grad_loss.reshape(-1)
        scale = grad_loss + grad_lse.reshape(-1)
        hit = (~outside).float() * grad_loss
        grad = torch.empty_like(flat)
        for rows in _ce_rows(flat):
            piece = _shifted(flat, rows, ctx.vocab_start, ctx.vocab_size, row_max).exp_()
            piece.div_(sum_exp[rows].unsqueeze(-1)).mul_(scale[rows].unsqueeze(-1))
            piece.scatter_add_(-1, local_target[rows].unsqueeze(-1), -hit[rows].unsqueeze(-1))
            grad[rows] = piece
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group,
    vocab_size: int | None = None,
    return_logsumexp: bool = False,
    times: StepTimes | None = None,
):
    """Per-token cross-entropy (fp32) from vocab-split logits [..., V/tp] and targets [...].

    Logits of ids >= vocab_size (vocabulary padding) are excluded from the softmax, so padding
    never changes the loss. Only [...]-shaped statistics cross the TP group. With
    return_logsumexp, also the (differentiable) log-partition per token, for z-loss.
    """
    vocab_start = group_rank(tp_group) * logits.shape[-1]
    loss, lse = _VocabParallelCrossEntropy.apply(
        logits, target, tp_group, vocab_start, vocab_size, times
    )
    return (loss, lse) if return_logsumexp else loss


def gather_logits(logits: torch.Tensor, tp_group, vocab_size: int | None = None) -> torch.Tensor:
    """Full-vocabulary logits (for inference and tests), padding columns dropped."""
    full = gather_from_tensor_parallel_region(logits, tp_group)
    return full[..., :vocab_size] if vocab_size is not None else full


def all_reduce_partial_grads(parameters, tp_group, grad_attr: str = "grad") -> None:
    """Sum the partial gradients of TP-replicated parameters (see mark_tp_partial_grad) over
    the TP group, in one flat all-reduce. grad_attr names where the gradient lives."""
    if tp_group is None:
        return
    grads = [
        getattr(p, grad_attr)
        for p in parameters
        if has_tp_partial_grad(p) and getattr(p, grad_attr, None) is not None
    ]
    all_reduce_flat(grads, tp_group)


def all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum every tensor of `grads` over `group` in place, in one flat fp32 all-reduce."""
    grads = [g for g in grads if g.numel()]
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
