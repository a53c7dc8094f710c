"""The matmul of tensor-parallel linears, with its communication written into backward.

One autograd function computes y = x W^T + b for column- and row-parallel layers and does, in
backward, what Megatron-LM's linear with asynchronous communication does:

- input_mode "copy" (column-parallel, no SP): the input gradient is all-reduced over the TP
  group in place, started asynchronously before the weight gradient is computed, so the two
  overlap;
- input_mode "gather" (column-parallel with sequence parallelism): forward all-gathers the
  [s/tp, b, h] input along the sequence but saves only this rank's shard for backward, which
  gathers it again (overlapped with the input-gradient GEMM) and reduce-scatters the input
  gradient (overlapped with the weight-gradient GEMM). Activation memory of the layer input is
  1/tp of the gathered tensor (a zero-bubble schedule's deferred weight gradient holds the
  gathered input and the output gradient until its W runs);
- input_mode "none" (row-parallel): no communication on the input side.

Given a `times` (parallel.timing.StepTimes), the communication this rank waits for counts as
"tp-comm": the forward gather, and in backward the launches and the waits of what the GEMMs
did not hide.

Gradient-accumulation fusion: when `fuse_wgrad` is set and the weight carries a `main_grad`
buffer (parallel/data_parallel/ddp.py gives every parameter one) and an `on_main_grad_added`
callback, the weight gradient is accumulated straight into `main_grad` (one in-place GEMM when
dtypes match; bf16 activations into an fp32 buffer: on CUDA one GEMM with an fp32 output,
elsewhere the GEMM in the activation dtype added in), no `.grad` is made, and the callback
tells the data-parallel wrapper the gradient is in (not under torch.compile: `fusable`). A
weight used twice in one graph (a tied embedding) must not take this path: autograd would no
longer wait for both uses before the callback. Without the buffer the gradient is returned to
autograd as usual.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from parallel.comm import all_gather_into, group_size, reduce_scatter_into
from parallel.pipeline.weight_grad import QUEUE_ATTRIBUTE
from parallel.tensor_parallel.regions import TP_COMM
from parallel.timing import measure

INPUT_MODES = ("none", "copy", "gather")


def _gather_sequence(x: torch.Tensor, group, async_op: bool = False):
    """(full tensor, work handle or None): every rank's x concatenated along dim 0."""
    x = x.contiguous()
    shape = (group_size(group) * x.shape[0],) + x.shape[1:]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    work = all_gather_into(out, x, group, async_op=async_op)
    return out, (work if async_op else None)


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, input_mode, fuse_wgrad, times, fp8, record):
        ctx.group, ctx.input_mode, ctx.fp8 = group, input_mode, fp8
        # the parameter itself, whose main_grad and callbacks backward uses (a saved tensor
        # may come back as another tensor object, e.g. under saved-tensor hooks)
        ctx.fused_param = weight if fuse_wgrad and fusable(weight) else None
        ctx.overlap = not torch.compiler.is_compiling()  # a traced graph takes no async_op
        ctx.has_bias, ctx.times = bias is not None, times
        total = x
        if input_mode == "gather":
            with measure(times, TP_COMM):
                total = _gather_sequence(x, group)[0]
        ctx.save_for_backward(x, weight)  # under "gather": the shard, not the gathered input
        if fp8 is None:
            return torch.nn.functional.linear(total, weight, bias)
        out, ctx.fp8_scales = fp8.forward(_as_matrix(total), weight, record)
        # the product's own tensor in the output's shape, not a view (a view made inside a
        # custom Function may not be modified in place, as the TP reduction does)
        out = torch.ops.aten._unsafe_view.default(out, (*total.shape[:-1], out.shape[-1]))
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group, mode, times, overlap = ctx.group, ctx.input_mode, ctx.times, ctx.overlap
        gather_work = None
        total = x
        if mode == "gather":
            with measure(times, TP_COMM):
                total, gather_work = _gather_sequence(x, group, async_op=overlap)
        fp8_wgrad = None  # the weight-gradient GEMM in FP8, with what input_grad leaves it
        if ctx.fp8 is None:
            grad_input = grad_output.matmul(weight)  # overlaps the gather above
        else:
            # (fp8_wgrad None under --no-fp8-wgrad: the usual GEMM, fp32 accumulation)
            grad_input, fp8_wgrad = ctx.fp8.backward(
                _as_matrix(grad_output), weight, ctx.fp8_scales
            )
            grad_input = grad_input.reshape(*grad_output.shape[:-1], weight.shape[1])
        reduce_work = None
        if mode == "copy":
            with measure(times, TP_COMM):
                reduce_work = dist.all_reduce(grad_input, group=group, async_op=overlap)
        elif mode == "gather":
            shard = torch.empty(
                (grad_input.shape[0] // group_size(group),) + grad_input.shape[1:],
                dtype=grad_input.dtype,
                device=grad_input.device,
            )
            with measure(times, TP_COMM):
                if gather_work is not None:
                    gather_work.wait()
                reduce_work = reduce_scatter_into(
                    shard, grad_input.contiguous(), group, async_op=overlap
                )
            grad_input = shard
        grad_weight = weight_grad(
            ctx.fused_param, _as_matrix(grad_output), _as_matrix(total), fp8_wgrad
        )
        grad_bias = _as_matrix(grad_output).sum(0) if ctx.has_bias else None
        if reduce_work is not None:
            with measure(times, TP_COMM):
                reduce_work.wait()  # the weight-gradient GEMM above ran while it was in flight
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def weight_grad(weight, grad_output_2d, input_2d, fp8_wgrad=None):
    """dL/dW = grad_output^T input, or None when it went straight into weight.main_grad (or
    was queued to: parallel/pipeline/weight_grad.py, for zero-bubble schedules); `weight`: the
    parameter when its gradient is fused in, else None; `fp8_wgrad`: the product in FP8
    (grad_output_2d, input_2d) -> fp32 dW, or None for the usual GEMM."""
    if weight is None:
        if fp8_wgrad is not None:
            return fp8_wgrad(grad_output_2d, input_2d).to(grad_output_2d.dtype)
        return grad_output_2d.t().matmul(input_2d)
    add = functools.partial(_add_to_main_grad, weight, grad_output_2d, input_2d, fp8_wgrad)
    queue = getattr(weight, QUEUE_ATTRIBUTE, None)
    if queue is not None:
        queue.add(weight, add)
        return None
    add()
    return None


def fusable(weight) -> bool:
    """Whether weight's gradient can go straight into its main_grad: it has one and the
    data-parallel wrapper's callback, and this is not being traced by torch.compile. A compiled
    backward returns the gradient instead (the wrapper's hook adds it in, eagerly): the
    wrapper's bookkeeping is Python state that a traced graph cannot replay, and reading it
    would make every layer's graph guard on its own parameters (a recompile per layer)."""
    if torch.compiler.is_compiling():
        return False
    return getattr(weight, "main_grad", None) is not None and hasattr(weight, "on_main_grad_added")


def _add_to_main_grad(weight, grad_output_2d, input_2d, fp8_wgrad=None) -> None:
    prepare = getattr(weight, "prepare_main_grad", None)
    if prepare is not None:
        prepare(weight)  # sharded gradients: the bucket's buffer may be released
    main_grad = weight.main_grad
    if fp8_wgrad is not None:
        main_grad.add_(fp8_wgrad(grad_output_2d, input_2d))
    elif main_grad.dtype == grad_output_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d)
    elif not _added_in_fp32(weight, main_grad, grad_output_2d.t(), input_2d):
        main_grad.add_(grad_output_2d.t().matmul(input_2d))
    weight.on_main_grad_added(weight)


def _added_in_fp32(weight, main_grad, a, b) -> bool:
    """`accumulate_in_fp32` on CUDA, unless it already failed for this weight."""
    if not main_grad.is_cuda or not getattr(weight, "fp32_output_gemm", True):
        return False
    if accumulate_in_fp32(main_grad, a, b):
        return True
    weight.fp32_output_gemm = False  # this torch cannot: not tried again for this weight
    return False


def accumulate_in_fp32(main_grad, a, b) -> bool:
    """main_grad += a @ b by one GEMM that reads bf16/fp16 a and b and accumulates into the
    fp32 buffer itself (torch's addmm with out_dtype, CUDA only), with no product made in the
    activation dtype first; False where this torch cannot (the caller then adds the product:
    older CUDA builds want the buffer in the inputs' dtype). Out of memory is raised."""
    try:
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
    except torch.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def tensor_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group,
    input_mode: str,
    fuse_wgrad: bool = False,
    times=None,
    fp8=None,
) -> torch.Tensor:
    """y = x W^T + b with the input-side TP communication of `input_mode` (module docstring).
    Without a group (TP 1) there is nothing to communicate. `fp8` (engine/ops/fp8/linear.py's
    Fp8Linear): the three GEMMs in FP8, the amaxes of delayed scaling recorded when gradients
    are on here (training; a custom Function's forward always runs without them)."""
    if input_mode not in INPUT_MODES:
        raise ValueError(f"input_mode {input_mode!r} is not one of {INPUT_MODES}")
    if group is None or group_size(group) == 1:
        input_mode = "none"
    record = fp8 is not None and torch.is_grad_enabled()
    return _TensorParallelLinear.apply(
        x, weight, bias, group, input_mode, fuse_wgrad, times, fp8, record
    )
