"""Data parallelism: contiguous gradient buffers reduced in buckets, overlapped with backward.

`DistributedDataParallel` moves a module's parameters into one contiguous buffer (their
`.data` become views of it) and gives each a `main_grad`: a view of a second buffer
("main grads": fp32, also for bf16/fp16 parameters, unless --grad-reduce-in-bf16 makes it
bf16). A hook adds every new `.grad` into `main_grad` and drops `.grad`, so gradients
accumulate locally over the micro-batches of a step. Linear layers with gradient-accumulation
fusion write into `main_grad` themselves and call `param.on_main_grad_added` instead.

The buffers are cut into buckets of about `bucket_size` elements, in the reverse order of the
parameters (roughly the order backward produces them). After the last micro-batch
(`no_sync()` marks the others) each bucket is reduced over the DP group: all-reduced, or with
the distributed optimizer reduce-scattered, so each rank gets its shard of the reduced
gradient. With `overlap_grad_reduce` a bucket's reduction starts inside backward as soon as
its last gradient is ready; `finish_grad_sync()` waits for all of them. Gradients are
pre-scaled by 1/DP, so the result is the average over data-parallel ranks.

A bucket holding a weight shared between pipeline stages (a tied embedding) is not reduced
inside backward: its gradient must first be summed with the other stage's copy (see
parallel/grads.py), so it waits for `finish_grad_sync()`.

With the distributed optimizer, buckets are padded to a multiple of 16 x DP elements so each
rank's shard has the same size, and after the optimizer step `start_param_sync()` all-gathers
the updated parameter shards, issued in forward order (the reverse of the bucket order), so
the first layers' parameters arrive first; with `overlap_param_gather` the wait happens per
module, in a forward pre-hook, just before the parameters are used (a tied output layer reads
the embedding table through the table's module call, so its hook runs too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel.comm import all_gather_into, group_rank, group_size, reduce_scatter_into

SHARD_ALIGNMENT = 16


@dataclass(eq=False)
class Bucket:
    """A contiguous slice [start, end) of both buffers and the parameters inside it."""

    index: int
    params: list[nn.Parameter]
    start: int
    end: int  # includes the padding
    grad: torch.Tensor  # view of the grad buffer
    data: torch.Tensor  # view of the parameter buffer
    pending: set = field(default_factory=set)
    delayed: bool = False  # holds a pipeline-shared weight: reduce in finish_grad_sync only
    grad_work: object = None
    grad_shard_tmp: torch.Tensor | None = None
    param_work: object = None

    @property
    def numel(self) -> int:
        return self.end - self.start


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; forward is the module's forward."""

    def __init__(
        self,
        module: nn.Module,
        dp_group,
        *,
        bucket_size: int | None = None,
        overlap_grad_reduce: bool = False,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        grad_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather and use_distributed_optimizer
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * self.dp_size)  # Megatron-LM's default
        self.bucket_size = bucket_size
        self.is_last_microbatch = True
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one chunk must share a dtype, found {dtypes}")
        self.param_dtype = dtypes.pop()
        self.param_range: dict[nn.Parameter, tuple[int, int]] = {}
        self._layout_buckets()
        device = self.params[0].device
        self.param_buffer = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        self.grad_buffer = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        for param in self.params:
            start, end = self.param_range[param]
            self.param_buffer[start:end].copy_(param.data.reshape(-1))
            param.data = self.param_buffer[start:end].view_as(param)
            param.main_grad = self.grad_buffer[start:end].view_as(param)
            param.on_main_grad_added = self._main_grad_added  # fused linears (tp_linear.py)
        for bucket in self.buckets:
            bucket.grad = self.grad_buffer[bucket.start : bucket.end]
            bucket.data = self.param_buffer[bucket.start : bucket.end]
            bucket.pending = set(bucket.params)
            bucket.delayed = any(getattr(p, "pipeline_shared", False) for p in bucket.params)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        if self.overlap_param_gather:
            for submodule in module.modules():
                if any(p in self.bucket_of for p in submodule.parameters(recurse=False)):
                    self._hooks.append(submodule.register_forward_pre_hook(self._wait_params))

    def _layout_buckets(self) -> None:
        """Reverse parameter order; cut a bucket once it holds bucket_size elements."""
        self.buckets: list[Bucket] = []
        offset, current, start = 0, [], 0
        alignment = SHARD_ALIGNMENT * self.dp_size if self.use_distributed_optimizer else 1

        def close(current, start, offset):
            end = -(-offset // alignment) * alignment
            self.buckets.append(Bucket(len(self.buckets), current, start, end, None, None))
            return end

        for param in reversed(self.params):
            self.param_range[param] = (offset, offset + param.numel())
            offset += param.numel()
            current.append(param)
            if offset - start >= self.bucket_size:
                offset = start = close(current, start, offset)
                current = []
        if current:
            offset = close(current, start, offset)
        self.numel = offset

    # --- forward / backward -----------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside only accumulate gradients; no reduction is started."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    def _grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
        self._main_grad_added(param)

    def _main_grad_added(self, param: nn.Parameter) -> None:
        """This micro-batch's gradient of param is in main_grad: with overlap, launch its
        bucket's reduction once every parameter in it is in."""
        if self.overlap_grad_reduce and self.is_last_microbatch and self.dp_group is not None:
            bucket = self.bucket_of[param]
            bucket.pending.discard(param)
            if not bucket.pending and bucket.grad_work is None and not bucket.delayed:
                self._start_bucket_reduce(bucket, async_op=True)

    def _start_bucket_reduce(self, bucket: Bucket, async_op: bool) -> None:
        bucket.grad.mul_(1.0 / self.dp_size)
        if self.use_distributed_optimizer:
            bucket.grad_shard_tmp = torch.empty(
                bucket.numel // self.dp_size, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            work = reduce_scatter_into(bucket.grad_shard_tmp, bucket.grad, self.dp_group, async_op)
        else:
            work = dist.all_reduce(bucket.grad, group=self.dp_group, async_op=async_op)
        bucket.grad_work = work if async_op else True
        if not async_op:
            self._complete_bucket_reduce(bucket)

    def _complete_bucket_reduce(self, bucket: Bucket) -> None:
        if bucket.grad_work not in (None, True):
            bucket.grad_work.wait()
        if bucket.grad_shard_tmp is not None:
            start, end = self.shard_range(bucket)
            self.grad_buffer[start:end].copy_(bucket.grad_shard_tmp)
            bucket.grad_shard_tmp = None
        bucket.grad_work = None

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet (non-overlapped path)."""
        if self.dp_group is None:
            return
        for bucket in self.buckets:
            if bucket.grad_work is None:
                self._start_bucket_reduce(bucket, async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every bucket reduced over DP."""
        if self.dp_group is None:
            return
        self.start_grad_sync()
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                self._complete_bucket_reduce(bucket)
            bucket.pending = set(bucket.params)

    def zero_grad_buffer(self) -> None:
        """Start of a step: clear main grads and re-arm the overlap bookkeeping."""
        self.grad_buffer.zero_()
        for param in self.params:
            param.grad = None
        for bucket in self.buckets:
            bucket.pending = set(bucket.params)
            bucket.grad_work = None

    # --- distributed optimizer support -------------------------------------------------

    def shard_range(self, bucket: Bucket, dp_rank: int | None = None) -> tuple[int, int]:
        """[start, end) in the buffers of a DP rank's shard of a bucket."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        size = bucket.numel // self.dp_size
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def start_param_sync(self) -> None:
        """After the optimizer updated this rank's shards: all-gather every bucket's
        parameters (waited for now, or lazily per module with overlap_param_gather)."""
        if not self.use_distributed_optimizer or self.dp_group is None:
            return
        for bucket in reversed(self.buckets):  # forward order: the first layers' come first
            start, end = self.shard_range(bucket)
            shard = self.param_buffer[start:end].clone()
            bucket.param_work = all_gather_into(
                bucket.data, shard, self.dp_group, async_op=self.overlap_param_gather
            )
            if not self.overlap_param_gather:
                bucket.param_work = None

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (before reading the parameters)."""
        for bucket in self.buckets:
            if bucket.param_work is not None:
                bucket.param_work.wait()
                bucket.param_work = None

    def _wait_params(self, module: nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            bucket = self.bucket_of.get(param)
            if bucket is not None and bucket.param_work is not None:
                bucket.param_work.wait()
                bucket.param_work = None

    def padding(self) -> int:
        """Buffer elements that belong to no parameter (bucket padding)."""
        return self.numel - sum(p.numel() for p in self.params)
