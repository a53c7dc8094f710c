"""Sharded parameters (--data-parallel-sharding-strategy optim_grads_params, ZeRO-3): each
DP rank keeps 1/DP of every parameter; a sharding unit's parameters (one bucket of
parallel/data_parallel/param_and_grad_buffer.py: a transformer layer, the embedding, the final
norm, the output layer) exist whole only while the unit computes.

- Forward: a pre-hook on the unit gathers its bucket (all-gather of the DP shards into the
  bucket's full storage) and starts gathering the next unit's; a post-hook releases it and
  hooks the unit's outputs, so that their gradient, the first sign of the unit's backward,
  gathers it again and starts gathering the unit called before it in that forward pass (for
  a tied output layer, the final norm, not the embedding's neighbour).
- Backward: once every parameter of the unit has its gradient, DDP reduce-scatters the
  gradient and releases the parameters (`release`); `DistributedDataParallel.end_backward`
  releases whatever is still gathered after each micro-batch's backward.
- Recomputation: a unit's forward run again inside backward (activation checkpointing)
  gathers it if needed and keeps it until its gradients are done.

FP8 weights (--fp8-param-gather) travel as E4M3 bytes with the scales their buffer made after
the optimizer's step (parallel/data_parallel/fp8_gather.py) and are set to those FP8 values.

Released parameters keep their shapes and autograd's saved references: only the storage is
shrunk to zero bytes and filled again in place by the next gather. Reading a released
parameter reads memory that is gone (a crash, not an error): code that reads parameters
outside forward does it inside `DistributedDataParallel.gathered_parameters()`, or reads
what a rank holds (`held_pieces`, as checkpoints do). Gathers are issued in
the same order on every DP rank because every rank runs the same schedule.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils._pytree import tree_leaves

from parallel.comm import all_gather_into
from parallel.data_parallel.buckets import allocate, release
from parallel.data_parallel.fp8_gather import gather_bytes, prepare_sharded_fp8, set_from_bytes


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitGathering:
    """Gathers and releases the buckets of `buffer` (a ParamAndGradBuffer; given in forward
    order) over its data-parallel group around their units' forward and backward."""

    def __init__(self, buffer, forward_order: list):
        self.buffer = buffer
        self.order = forward_order
        self.position = {bucket: i for i, bucket in enumerate(forward_order)}
        self.pass_units: list = []  # units called in the current forward pass, in call order
        self.calls: list = []  # (unit, the unit called before it) of calls in progress
        self.hooks = []
        for bucket in forward_order:
            unit = bucket.unit
            self.hooks.append(unit.register_forward_pre_hook(partial(self._before_forward, bucket)))
            self.hooks.append(unit.register_forward_hook(partial(self._after_forward, bucket)))

    # --- gathers ----------------------------------------------------------------------------

    def start_gather(self, bucket) -> None:
        """Start gathering bucket's parameters (nothing if gathered or on the way)."""
        if bucket.gathered or bucket.param_work is not None:
            return
        allocate(bucket.data)
        buffer = self.buffer
        if buffer.fp8_gather:  # the shards travel as E4M3 bytes (fp8_gather.py)
            if bucket.fp8_shard is None:
                prepare_sharded_fp8(buffer)
            shard, scales = bucket.fp8_shard
            wire, bucket.param_work = gather_bytes(buffer, bucket, shard, async_op=True)
            bucket.fp8_wire = (wire, scales)
            if bucket.param_work is None:
                self._landed(bucket)
            return
        if buffer.dp_group is None:
            bucket.data.copy_(bucket.data_shard)
            bucket.gathered = True
            return
        bucket.param_work = all_gather_into(
            bucket.data, bucket.data_shard, buffer.dp_group, async_op=True
        )

    def _landed(self, bucket) -> None:
        """A gather in flight has arrived: the parameters are whole (FP8 bytes turned into the
        weights' values)."""
        if bucket.param_work is not None:
            bucket.param_work.wait()
            bucket.param_work = None
        if bucket.fp8_wire is not None:
            set_from_bytes(self.buffer, bucket, *bucket.fp8_wire)
            bucket.fp8_wire = None
        bucket.gathered = True

    def wait_gather(self, bucket) -> None:
        """bucket's parameters whole, now."""
        self.start_gather(bucket)
        if not bucket.gathered:
            self._landed(bucket)

    def release(self, bucket) -> None:
        """Free bucket's full parameters (after any gather in flight has landed)."""
        if bucket.param_work is not None:
            bucket.param_work.wait()
            bucket.param_work = None
            bucket.fp8_wire = None
            bucket.gathered = True
        if bucket.gathered:
            release(bucket.data)
            bucket.gathered = False

    def release_all(self) -> None:
        for bucket in self.order:
            self.release(bucket)

    # --- hooks ------------------------------------------------------------------------------

    def _following(self, bucket):
        index = self.position[bucket] + 1
        return self.order[index] if index < len(self.order) else None

    def _before_forward(self, bucket, module, args) -> None:
        self.wait_gather(bucket)
        if _in_backward():  # recomputation
            self.calls.append((bucket, None))
            return
        if self.position[bucket] == 0:  # the first unit: a new forward pass
            self.pass_units, self.calls = [], []
        previous = self.pass_units[-1] if self.pass_units else None
        following = self._following(bucket)
        if following is not None and bucket not in self.pass_units:
            self.start_gather(following)  # prefetch: it runs next (not after a second call)
        self.pass_units.append(bucket)
        self.calls.append((bucket, previous))

    def _after_forward(self, bucket, module, args, output) -> None:
        _, previous = self.calls.pop()
        if _in_backward():
            return  # recomputation: kept until its gradients are in
        self.release(bucket)
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._before_backward, bucket, previous))

    def _before_backward(self, bucket, previous, grad) -> None:
        self.wait_gather(bucket)
        if previous is not None:
            self.start_gather(previous)  # prefetch: the unit that ran before it runs backward next
