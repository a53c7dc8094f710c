"""Random-number streams for model parallelism, and activation recomputation that replays them.

Two kinds of randomness in a TP model:
- the default stream, seeded identically on every rank of a TP group, for dropout on tensors
  that are replicated across the group (they must stay identical on every rank);
- the tracker's per-TP-rank stream ("model-parallel-rng"), for dropout on TP-split tensors
  (attention heads, and sequence chunks under sequence parallelism).

The tracker keeps named generator states and swaps one into the device's default generator
for the duration of `fork()`, so ordinary ops (F.dropout, SDPA dropout) draw from it.
`checkpoint()` snapshots the default and tracker states at forward time and restores them
while recomputing, so recomputed dropout masks equal the original ones.
"""

from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG streams on one device, swapped in and out of its default generator."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream `name`; its advanced state is kept for the next fork."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name} was never added")
        saved = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, saved)


def model_parallel_seed(
    seed: int, tp_rank: int, pp_rank: int, device: torch.device | str = "cpu", cp_rank: int = 0
) -> RNGStatesTracker:
    """Seed the default stream (shared by a TP group, distinct per pipeline stage) and return
    a tracker whose model-parallel stream is distinct per TP rank (Megatron-LM's offsets).
    Context-parallel ranks hold different tokens, so their streams differ too (no offset at
    CP rank 0: the seeds of runs without CP are unchanged)."""
    device = torch.device(device)
    default_seed = seed + 100 * pp_rank + 7919 * cp_rank
    torch.manual_seed(default_seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, default_seed + 2718 + tp_rank)
    return tracker


class _Recompute(torch.autograd.Function):
    """Run `function` without keeping activations; recompute it in backward with the RNG
    states of the original forward (default stream and every tracker stream)."""

    @staticmethod
    def forward(ctx, function, tracker, *args):
        ctx.function, ctx.tracker = function, tracker
        device = tracker.device if tracker is not None else torch.device("cpu")
        ctx.device = device
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = _get_state(device) if device.type == "cuda" else None
        ctx.tracker_states = tracker.get_states() if tracker is not None else None
        tensor_positions, tensors, others = [], [], []
        for position, arg in enumerate(args):
            if torch.is_tensor(arg):
                tensor_positions.append(position)
                tensors.append(arg)
            others.append(None if torch.is_tensor(arg) else arg)
        ctx.tensor_positions, ctx.others = tensor_positions, others
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = list(ctx.others)
        inputs = []
        for position, tensor in zip(ctx.tensor_positions, saved, strict=False):
            detached = tensor.detach().requires_grad_(tensor.requires_grad)
            args[position] = detached
            inputs.append(detached)
        now_cpu = torch.get_rng_state()
        now_device = _get_state(ctx.device) if ctx.device_state is not None else None
        now_tracker = ctx.tracker.get_states() if ctx.tracker is not None else None
        torch.set_rng_state(ctx.cpu_state)
        if ctx.device_state is not None:
            _set_state(ctx.device, ctx.device_state)
        if ctx.tracker is not None:
            ctx.tracker.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            torch.set_rng_state(now_cpu)
            if now_device is not None:
                _set_state(ctx.device, now_device)
            if now_tracker is not None:
                ctx.tracker.set_states(now_tracker)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=False)
            if torch.is_tensor(o) and o.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(
            inputs[ctx.tensor_positions.index(p)].grad if p in ctx.tensor_positions else None
            for p in range(len(args))
        )


def checkpoint(function, tracker: RNGStatesTracker | None, *args):
    """Activation recomputation of function(*args) that replays the RNG streams exactly."""
    return _Recompute.apply(function, tracker, *args)
