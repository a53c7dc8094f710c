"""Data parallelism: a model chunk's gradients reduced in overlapped buckets, with Megatron-LM's
sharding strategies (--data-parallel-sharding-strategy).

`DistributedDataParallel` wraps one model chunk; forward is the module's forward. Its
parameters live in contiguous buffers, reduced bucket by bucket over a data-parallel group
(parallel/data_parallel/param_and_grad_buffer.py: the buckets, the strategies, what a rank
keeps). A hook adds every new `.grad` into the parameter's `main_grad` and drops `.grad`, so
gradients accumulate locally over the micro-batches of a step; linear layers with
gradient-accumulation fusion write into `main_grad` themselves (after
`param.prepare_main_grad`) and call `param.on_main_grad_added`. Micro-batches inside
`no_sync()` only accumulate (with sharded gradients every micro-batch is reduced).

One buffer holds the parameters, reduced over DP x CP. With expert parallelism
(`expert_dp_group` given), the routed experts' parameters (parallel/expert_parallel/params.py)
get a buffer of their own, reduced and sharded over the expert data-parallel group: the ranks
holding the same experts. A rank's expert gradient already sums the gradients of the tokens
every rank of its expert-parallel group sent it, so both buffers are pre-scaled by 1/(DP x CP)
(megatron-core's expert_gradient_scaling_factor): the sum over the expert data-parallel group
is then the average over DP x CP, as for the dense parameters. With --fp8-param-gather the FP8
layers' weights are apart again (a dense and an expert buffer of them), gathered in FP8
(parallel/data_parallel/fp8_gather.py).

With `overlap_param_gather` (the distributed optimizer's `optim` and `optim_grads`) each
module waits for its parameters' all-gathers in a forward pre-hook, just before they are used
(a tied output layer reads the embedding table through the table's module call, so its hook
runs; a module reading its children's weights without calling them says so with
`reads_child_parameters`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from parallel.comm import group_size
from parallel.data_parallel.buckets import Bucket
from parallel.data_parallel.fp8_gather import is_fp8_gathered
from parallel.data_parallel.param_and_grad_buffer import STRATEGIES, ParamAndGradBuffer
from parallel.expert_parallel.params import is_expert_parallel
from parallel.pipeline.weight_grad import QUEUE_ATTRIBUTE

_DENSE = object()  # no expert buffer: the experts' parameters reduced with the rest


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk. `sharding` is one of STRATEGIES (default: `optim` with
    use_distributed_optimizer, else `no_shard`); with `optim_grads_params`, `units` are the
    modules whose parameters are gathered together (default: the module's
    `sharding_units()`, else the whole module). `expert_dp_group`: with expert parallelism,
    the group the experts' buffer is reduced over (module docstring)."""

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
        sharding: str | None = None,
        units: list[nn.Module] | None = None,
        replica_group=None,
        expert_dp_group=_DENSE,
    ):
        super().__init__()
        sharding = sharding or ("optim" if use_distributed_optimizer else "no_shard")
        if sharding not in STRATEGIES:
            raise ValueError(f"sharding strategy {sharding!r} is not one of {STRATEGIES}")
        self.module = module
        self.sharding = sharding
        self.use_distributed_optimizer = sharding != "no_shard"
        self.shard_params = sharding == "optim_grads_params"
        replicas = group_size(replica_group)
        if replicas > 1 and not self.use_distributed_optimizer:
            raise ValueError("optimizer instances (a replica group) need a sharding strategy")
        self.is_last_microbatch = True
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        dp_size = group_size(dp_group)
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * dp_size)  # Megatron-LM's default
        if self.shard_params and units is None:
            get_units = getattr(module, "sharding_units", None)
            units = get_units() if get_units is not None else []
        overlap_param_gather = overlap_param_gather and sharding in ("optim", "optim_grads")
        options = dict(
            sharding=sharding,
            bucket_size=bucket_size,
            grad_dtype=grad_dtype,
            grad_scale=1.0 / (dp_size * replicas),
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
            units=units,
        )
        split = expert_dp_group is not _DENSE
        dense = [p for p in self.params if not (split and is_expert_parallel(p))]
        experts = [p for p in self.params if split and is_expert_parallel(p)]
        if split and replicas > 1 and experts:
            raise ValueError("expert parallelism with optimizer instances is not built")
        self.buffers: list[ParamAndGradBuffer] = []
        for fp8 in (False, True):  # FP8 weights gathered in FP8: buffers of their own
            mine = [p for p in dense if is_fp8_gathered(p) == fp8]
            if mine:
                self.buffers.append(
                    ParamAndGradBuffer(
                        module,
                        mine,
                        dp_group,
                        replica_group=replica_group,
                        fp8_gather=fp8,
                        **options,
                    )  # fmt: skip
                )
            mine = [p for p in experts if is_fp8_gathered(p) == fp8]
            if mine:
                self.buffers.append(
                    ParamAndGradBuffer(
                        module, mine, expert_dp_group, is_expert=True, fp8_gather=fp8, **options
                    )
                )
        self.buffer_of = {p: buffer for buffer in self.buffers for p in buffer.params}
        self.bucket_of = {p: b for buffer in self.buffers for p, b in buffer.bucket_of.items()}
        for param in self.params:
            param.on_main_grad_added = self._main_grad_added  # fused linears (tp_linear.py)
            param.prepare_main_grad = self._prepare_main_grad
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        if overlap_param_gather:
            for submodule in module.modules():
                if any(p in self.bucket_of for p in _read_parameters(submodule)):
                    self._hooks.append(submodule.register_forward_pre_hook(self._wait_params))

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket of every buffer."""
        return [bucket for buffer in self.buffers for bucket in buffer.buckets]

    @property
    def before_reduce(self) -> Callable[[Bucket], None] | None:
        """Called with each bucket right before its reduction (engine/monitor/noise_scale.py)."""
        return self.buffers[0].before_reduce

    @before_reduce.setter
    def before_reduce(self, hook: Callable[[Bucket], None] | None) -> None:
        for buffer in self.buffers:
            buffer.before_reduce = hook

    # --- forward / backward -----------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside only accumulate gradients; no reduction is started (with
        sharded gradients every micro-batch is reduced: nothing to do)."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    def _prepare_main_grad(self, param: nn.Parameter) -> None:
        self.buffer_of[param].prepare_main_grad(param)

    def _grad_ready(self, param: nn.Parameter) -> None:
        buffer = self.buffer_of[param]
        queue = getattr(param, QUEUE_ATTRIBUTE, None)
        if queue is not None and buffer.gathering is not None:
            buffer.passed_in_split_backward(param)
        if param.grad is None and queue is not None and queue.defers(param):
            return  # its weight gradient was deferred (parallel/pipeline/weight_grad.py): W adds it
        if param.grad is not None:
            buffer.prepare_main_grad(param)
            param.main_grad.add_(param.grad)
            param.grad = None
        self._main_grad_added(param)

    def _main_grad_added(self, param: nn.Parameter) -> None:
        self.buffer_of[param].main_grad_added(param, self.is_last_microbatch)

    def end_input_backward(self) -> None:
        """After each input-gradient backward (I): release what is still gathered (a unit
        with a parameter that got no gradient)."""
        for buffer in self.buffers:
            buffer.end_input_backward()

    def end_backward(self) -> None:
        """After each micro-batch's backward (the schedules call it); see
        ParamAndGradBuffer.end_backward."""
        for buffer in self.buffers:
            buffer.end_backward()

    def start_grad_sync(self) -> None:
        for buffer in self.buffers:
            buffer.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every bucket reduced."""
        for buffer in self.buffers:
            buffer.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.zero_grad_buffer()

    # --- where this rank's values live --------------------------------------------------

    def held_pieces(self, param: nn.Parameter) -> list[tuple[int, int, torch.Tensor]]:
        """(offset, numel, flat values) of the parts of param this rank holds at rest: the
        whole parameter, or with sharded parameters the part inside this rank's shard."""
        buffer = self.buffer_of[param]
        if not buffer.shard_params:
            return [(0, param.numel(), param.data.reshape(-1))]
        part = buffer.in_own_shard(param)
        if part is None:
            return []
        bucket, a, b = part
        return [(a - buffer.param_range[param][0], b - a, buffer.data_of(bucket, a, b))]

    def reduced_grads(self, param: nn.Parameter) -> list[torch.Tensor]:
        """The reduced gradient of param this rank holds after finish_grad_sync (whole, or
        the part inside its shard), as flat tensors."""
        buffer = self.buffer_of[param]
        if not buffer.shard_grads:
            return [param.main_grad.reshape(-1)]
        part = buffer.in_own_shard(param)
        return [] if part is None else [buffer.grad_of(*part)]

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Every parameter whole inside (sharded parameters are gathered, then released):
        for reading them outside forward, e.g. in tests."""
        if not self.shard_params:
            self.finish_param_sync()
            yield
            return
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                buffer.gathering.wait_gather(bucket)
        try:
            yield
        finally:
            for buffer in self.buffers:
                buffer.gathering.release_all()

    def padding(self) -> int:
        """Buffer elements that belong to no parameter (bucket padding)."""
        return sum(buffer.padding() for buffer in self.buffers)

    # --- parameter gathers after the optimizer step ---------------------------------------

    def start_param_sync(self) -> None:
        for buffer in self.buffers:
            buffer.start_param_sync()

    def finish_param_sync(self) -> None:
        for buffer in self.buffers:
            buffer.finish_param_sync()

    def _wait_params(self, module: nn.Module, args) -> None:
        for param in _read_parameters(module):
            bucket = self.bucket_of.get(param)
            if bucket is not None and bucket.param_work is not None:
                bucket.param_work.wait()
                bucket.param_work = None


def _read_parameters(module: nn.Module):
    """The parameters a module's forward reads itself: its own, or with
    `reads_child_parameters` (a module that reads its children's weights without calling
    them, e.g. the MoE experts' grouped GEMM) its descendants' too."""
    return module.parameters(recurse=getattr(module, "reads_child_parameters", False))
