"""The parameters and gradients of one data-parallel group, in contiguous buffers reduced in
buckets: the machinery under DistributedDataParallel (parallel/data_parallel/ddp.py), which
holds one buffer for a model chunk's parameters, or with expert parallelism two (the dense
parameters over DP x CP, the experts' over the expert data-parallel group).

Parameters are moved into the buffers (their `.data` become views) and each gets a
`main_grad`: a view of a gradient buffer ("main grads": fp32, also for bf16/fp16 parameters,
unless --grad-reduce-in-bf16 makes it bf16). The buffers are cut into buckets of about
`bucket_size` elements, in the reverse order of the parameters (roughly the order backward
produces them). Each bucket is reduced over the buffer's group, its gradients pre-scaled by
`grad_scale` (1/DP for the dense parameters, so the result is the average over DP ranks). What
a rank keeps depends on the strategy:

- `no_shard`: everything whole on every rank; buckets are all-reduced after the last
  micro-batch.
- `optim` (--use-distributed-optimizer, ZeRO-1): buckets are reduce-scattered after the last
  micro-batch, so each rank gets its 1/DP shard of the reduced gradient; the optimizer
  (parallel/data_parallel/optimizer.py) updates that shard and `start_param_sync()` all-gathers the
  parameters, in forward order (the reverse of the bucket order); with `overlap_param_gather` the
  wait happens per module (DistributedDataParallel's forward pre-hooks).
- `optim_grads` (ZeRO-2): a rank keeps only its shard of the reduced gradient. A bucket's full
  gradient exists only while its micro-batch's backward fills it: once every parameter in it
  has its gradient, it is reduce-scattered, added to the shard and its memory released (every
  micro-batch; `end_backward()`, which the schedules call after each backward, flushes the
  rest). Memory per parameter, bf16 with fp32 masters: 2 + (4 + 12) / DP bytes. Under a
  schedule that splits backward (zb-h1, zb-v, dualpipe-v) a bucket holding a deferred weight
  gradient stays allocated from a micro-batch's I until its W: at that peak a chunk's full
  gradient can be held, as without sharding.
- `optim_grads_params` (ZeRO-3): the parameters are sharded too; see
  parallel/data_parallel/fsdp_params.py. Buckets follow the model's sharding units (a transformer
  layer, the embedding, ...), whose parameters are all-gathered just before their forward and again
  before their backward, and released after. 18 / DP bytes per parameter.

With several distributed-optimizer instances (Megatron-LM's --num-distributed-optimizer-instances,
`replica_group`), `dp_group` is one instance's part of DP and the shards are cut over it; each
reduced shard is then all-reduced over `replica_group` (the ranks holding the same shard in the
other instances), the gradients pre-scaled by 1/(DP x instances): every instance keeps the
whole DP average, and updates it alike.

With `overlap_grad_reduce` a bucket's reduction starts inside backward as soon as its last
gradient is ready (always so with sharded gradients); `finish_grad_sync()` waits for all.
A bucket holding a weight shared between pipeline stages (a tied embedding) is reduced only
in `finish_grad_sync()`: its gradient must first be summed with the other stage's copy (see
parallel/grads.py), so its full gradient is kept under every strategy.

How buckets are laid out, padded (with any sharding, to a multiple of 16 x DP elements so
each rank's shard has the same size) and their memory released and given back: see
parallel/data_parallel/buckets.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from parallel.comm import all_gather_into, group_rank, group_size, reduce_scatter_into
from parallel.data_parallel.buckets import (
    SHARD_ALIGNMENT,
    Bucket,
    allocate,
    is_allocated,
    layout_buckets,
    layout_unit_buckets,
    release,
)
from parallel.data_parallel.fp8_gather import gather_fp8_weights, prepare_sharded_fp8

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class ParamAndGradBuffer:
    """The buffers and buckets of `params` (trainable, one dtype), reduced over `dp_group`
    (and `replica_group`) under `sharding`, one of STRATEGIES. With `optim_grads_params`,
    `units` are the modules whose parameters are gathered together (the rest of `module`'s
    parameters form one more unit, the module). `is_expert`: the experts' buffer."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        dp_group,
        *,
        sharding: str,
        bucket_size: int,
        grad_dtype: torch.dtype,
        grad_scale: float,
        overlap_grad_reduce: bool,
        overlap_param_gather: bool,
        units: list[nn.Module] | None,
        replica_group=None,
        is_expert: bool = False,
        fp8_gather: bool = False,
    ):
        if fp8_gather and sharding == "no_shard":
            raise ValueError("FP8 parameter gathers need the distributed optimizer's sharding")
        self.fp8_gather = fp8_gather
        self.params = params
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        self.replica_group = replica_group
        self.grad_scale = grad_scale
        self.is_expert = is_expert
        self.sharding = sharding
        self.use_distributed_optimizer = sharding != "no_shard"
        # nothing to reduce or scale (an expert buffer on its own still scales by 1/DP)
        self.alone = dp_group is None and replica_group is None and grad_scale == 1.0
        self.shard_grads = sharding in ("optim_grads", "optim_grads_params")
        self.shard_params = sharding == "optim_grads_params"
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        # called with each bucket right before its reduction (engine/monitor/noise_scale.py)
        self.before_reduce: Callable[[Bucket], None] | None = None
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one chunk must share a dtype, found {dtypes}")
        self.param_dtype = dtypes.pop()
        alignment = SHARD_ALIGNMENT * self.dp_size if self.use_distributed_optimizer else 1
        if self.shard_params:
            layout = layout_unit_buckets(module, params, units or [], alignment)
        else:
            layout = layout_buckets(params, bucket_size, alignment)
        self.buckets, self.param_range, self.numel = layout
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._make_buffers(params[0].device, grad_dtype)
        self.gathering = None
        if self.shard_params:
            from parallel.data_parallel.fsdp_params import UnitGathering

            self.gathering = UnitGathering(self, list(reversed(self.buckets)))

    def _make_buffers(self, device, grad_dtype) -> None:
        """Where parameters and gradients live for the strategy (module docstring)."""
        shard_numel = self.numel // self.dp_size if self.use_distributed_optimizer else 0
        self.param_shard_buffer = self.grad_shard_buffer = None
        if self.shard_params:
            self.param_buffer = None
            self.param_shard_buffer = torch.zeros(
                shard_numel, dtype=self.param_dtype, device=device
            )
        else:
            self.param_buffer = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        if self.shard_grads:
            self.grad_buffer = None
            self.grad_shard_buffer = torch.zeros(shard_numel, dtype=grad_dtype, device=device)
        else:
            self.grad_buffer = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        for bucket in self.buckets:
            base = bucket.start // self.dp_size
            size = bucket.numel // self.dp_size
            if self.shard_params:
                bucket.data = torch.zeros(bucket.numel, dtype=self.param_dtype, device=device)
                bucket.data_shard = self.param_shard_buffer[base : base + size]
            else:
                bucket.data = self.param_buffer[bucket.start : bucket.end]
            if self.shard_grads:
                bucket.grad = torch.zeros(bucket.numel, dtype=grad_dtype, device=device)
                bucket.grad_shard = self.grad_shard_buffer[base : base + size]
            else:
                bucket.grad = self.grad_buffer[bucket.start : bucket.end]
            for param in bucket.params:
                start, end = self.param_range[param]
                local = slice(start - bucket.start, end - bucket.start)
                bucket.data[local].copy_(param.data.reshape(-1))
                param.data = bucket.data[local].view_as(param)
                param.main_grad = bucket.grad[local].view_as(param)
            if self.shard_params:
                lo, hi = self.shard_range(bucket)
                bucket.data_shard.copy_(bucket.data[lo - bucket.start : hi - bucket.start])
                release(bucket.data)
            if self.shard_grads and not bucket.delayed:
                release(bucket.grad)

    # --- gradients arriving -------------------------------------------------------------

    def prepare_main_grad(self, param: nn.Parameter) -> None:
        """Before a gradient is added into main_grad, with sharded gradients: a reduction of
        its bucket still in flight is landed first (a zero-bubble schedule runs the next
        micro-batch's input-gradient backward before the previous one's deferred weight
        gradients, so a bucket reduced in one can be written again by the next; that
        gradient is reduced later, by the bucket's next reduction or `end_backward`), and a
        released bucket gradient is allocated again, zeroed."""
        bucket = self.bucket_of[param]
        if not self.shard_grads:
            return
        if bucket.grad_work is not None and not bucket.delayed:
            self._complete_bucket_reduce(bucket)
        if not is_allocated(bucket.grad):
            allocate(bucket.grad)
            bucket.grad.zero_()

    def passed_in_split_backward(self, param: nn.Parameter) -> None:
        """An input-gradient backward (a zero-bubble schedule's I) is done with param: its
        gradient is in, or queued for W, which needs no parameters. Once it is done with
        every parameter of a unit, the unit's gathered parameters are released (the bucket's
        gradient still waits for W's part before it is reduced)."""
        bucket = self.bucket_of[param]
        bucket.passed.add(param)
        if len(bucket.passed) == len(bucket.params):
            bucket.passed = set()
            self.gathering.release(bucket)

    def end_input_backward(self) -> None:
        for bucket in self.buckets:
            bucket.passed = set()
        if self.gathering is not None:
            self.gathering.release_all()

    def main_grad_added(self, param: nn.Parameter, is_last_microbatch: bool) -> None:
        """This micro-batch's gradient of param is in main_grad: once every parameter of its
        bucket is in, reduce it (with overlap or sharded gradients) and release the gathered
        parameters (sharded parameters)."""
        bucket = self.bucket_of[param]
        if self.shard_grads:
            if param not in bucket.pending:  # told twice (a fused linear, then autograd)
                return
            bucket.pending.discard(param)
            if not bucket.pending:
                if not bucket.delayed and bucket.grad_work is None:
                    self._start_bucket_reduce(bucket, async_op=self.overlap_grad_reduce)
                    self._complete_earlier_reduces(bucket)
                if self.gathering is not None:
                    self.gathering.release(bucket)
        elif self.overlap_grad_reduce and is_last_microbatch and self.dp_group is not None:
            # (without a group nothing runs asynchronously: finish_grad_sync scales and
            # completes every bucket once)
            bucket.pending.discard(param)
            if not bucket.pending and bucket.grad_work is None and not bucket.delayed:
                self._start_bucket_reduce(bucket, async_op=True)

    # --- reductions ---------------------------------------------------------------------

    def _start_bucket_reduce(self, bucket: Bucket, async_op: bool) -> None:
        if self.before_reduce is not None:  # sees this rank's own gradient of the bucket
            self.before_reduce(bucket)
        bucket.grad.mul_(self.grad_scale)
        if self.use_distributed_optimizer:
            bucket.grad_shard_tmp = torch.empty(
                bucket.numel // self.dp_size, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            if self.dp_group is None:  # one rank: its shard is the whole bucket
                bucket.grad_shard_tmp.copy_(bucket.grad)
                work = None
            else:
                work = reduce_scatter_into(
                    bucket.grad_shard_tmp, bucket.grad, self.dp_group, async_op
                )
        elif self.dp_group is None:  # one rank (an expert buffer): scaled, nothing to sum
            work = None
        else:
            work = dist.all_reduce(bucket.grad, group=self.dp_group, async_op=async_op)
        bucket.grad_work = work if async_op and work is not None else True
        if bucket.grad_work is True:
            self._complete_bucket_reduce(bucket)

    def _complete_earlier_reduces(self, started: Bucket) -> None:
        """Sharded gradients: one reduction in flight at a time. Starting one completes the
        one before (it ran during this bucket's backward) and releases its full gradient, so
        a plain backward holds at most two full bucket gradients at once (a split one also
        holds those waiting for their W: module docstring)."""
        for bucket in self.buckets:
            in_flight = bucket.grad_work is not None and bucket.grad_work is not True
            if bucket is not started and in_flight and not bucket.delayed:
                self._complete_bucket_reduce(bucket)

    def _complete_bucket_reduce(self, bucket: Bucket) -> None:
        if bucket.grad_work not in (None, True):
            bucket.grad_work.wait()
        if bucket.grad_shard_tmp is not None and self.replica_group is not None:
            dist.all_reduce(bucket.grad_shard_tmp, group=self.replica_group)  # other instances
        if bucket.grad_shard_tmp is not None:
            if self.shard_grads:
                bucket.grad_shard.add_(bucket.grad_shard_tmp)
                if not bucket.delayed:
                    release(bucket.grad)
            else:
                start, end = self.shard_range(bucket)
                self.grad_buffer[start:end].copy_(bucket.grad_shard_tmp)
            bucket.grad_shard_tmp = None
        bucket.grad_work = None

    def end_backward(self) -> None:
        """After each micro-batch's backward, with sharded gradients: reduce what is still
        held (parameters that got no gradient leave a bucket pending), wait for the
        reductions in flight and release gathered parameters."""
        if not self.shard_grads:
            return
        for bucket in self.buckets:
            live = is_allocated(bucket.grad) and not bucket.delayed
            if live and bucket.grad_work is None:
                self._start_bucket_reduce(bucket, async_op=False)
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                self._complete_bucket_reduce(bucket)
            bucket.pending = set(bucket.params)
        if self.gathering is not None:
            self.gathering.release_all()

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet (non-overlapped path)."""
        if self.alone and not self.shard_grads:
            return
        for bucket in self.buckets:
            if bucket.grad_work is None and (bucket.delayed or not self.shard_grads):
                self._start_bucket_reduce(bucket, async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every bucket reduced."""
        self.end_backward()
        if self.alone and not self.shard_grads:
            return
        self.start_grad_sync()
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                self._complete_bucket_reduce(bucket)
            bucket.pending = set(bucket.params)

    def zero_grad_buffer(self) -> None:
        """Start of a step: clear main grads and re-arm the overlap bookkeeping."""
        for param in self.params:
            param.grad = None
        if self.shard_grads:
            self.grad_shard_buffer.zero_()
        else:
            self.grad_buffer.zero_()
        for bucket in self.buckets:
            if self.shard_grads and is_allocated(bucket.grad):
                if bucket.delayed:
                    bucket.grad.zero_()
                else:
                    release(bucket.grad)
            bucket.pending = set(bucket.params)
            bucket.grad_work = None

    # --- where this rank's values live --------------------------------------------------

    def shard_range(self, bucket: Bucket, dp_rank: int | None = None) -> tuple[int, int]:
        """[start, end) in the flattened parameters of a DP rank's shard of a bucket."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        size = bucket.numel // self.dp_size
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def _in_shard(self, bucket: Bucket, start: int, end: int) -> slice:
        lo, hi = self.shard_range(bucket)
        if not lo <= start <= end <= hi:
            raise ValueError(f"[{start}, {end}) is not inside this rank's shard [{lo}, {hi})")
        base = bucket.start // self.dp_size
        return slice(base + start - lo, base + end - lo)

    def data_of(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """Where this rank keeps the parameters [start, end) (flattened offsets) of bucket."""
        if self.shard_params:
            return self.param_shard_buffer[self._in_shard(bucket, start, end)]
        return self.param_buffer[start:end]

    def grad_of(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """Where this rank finds the reduced gradient of [start, end) after finish_grad_sync."""
        if self.shard_grads:
            return self.grad_shard_buffer[self._in_shard(bucket, start, end)]
        return self.grad_buffer[start:end]

    def in_own_shard(self, param: nn.Parameter) -> tuple[Bucket, int, int] | None:
        """(bucket, start, end): the flattened range of param inside this rank's shard of its
        bucket, or None when none of it is."""
        bucket = self.bucket_of[param]
        start, end = self.param_range[param]
        lo, hi = self.shard_range(bucket)
        a, b = max(start, lo), min(end, hi)
        return (bucket, a, b) if a < b else None

    # --- parameter gathers after the optimizer step ---------------------------------------

    def start_param_sync(self) -> None:
        """After the optimizer updated this rank's shards: all-gather every bucket's
        parameters (waited for now, or lazily per module with overlap_param_gather). Sharded
        parameters are gathered by their units' forward instead. FP8 weights: gathered in FP8
        now (parallel/data_parallel/fp8_gather.py)."""
        if self.fp8_gather and self.shard_params:  # gathered by the units' forward
            prepare_sharded_fp8(self)
            return
        if self.fp8_gather:
            gather_fp8_weights(self)
            return
        if self.sharding not in ("optim", "optim_grads") or self.dp_group is None:
            return
        for bucket in reversed(self.buckets):  # forward order: the first layers' come first
            start, end = self.shard_range(bucket)
            # in place, as megatron-core: the shard is this rank's slice of the output
            shard = self.param_buffer[start:end]
            bucket.param_work = all_gather_into(
                bucket.data, shard, self.dp_group, async_op=self.overlap_param_gather
            )
            if not self.overlap_param_gather:
                bucket.param_work = None

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (before reading the parameters). With
        sharded parameters: release every unit still gathered (a forward-only pass can leave
        a prefetched unit that never ran), waiting for its gather first."""
        if self.gathering is not None:
            self.gathering.release_all()
            return
        for bucket in self.buckets:
            if bucket.param_work is not None:
                bucket.param_work.wait()
                bucket.param_work = None

    def padding(self) -> int:
        """Buffer elements that belong to no parameter (bucket padding)."""
        return self.numel - sum(p.numel() for p in self.params)
