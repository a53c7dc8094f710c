"""Forward/backward schedules over the micro-batches of one global batch.

A schedule is given the model chunks this rank holds (DDP-wrapped), the micro-batches, and two
callables from the engine (parallel/ knows nothing about tokens or losses):

    forward_step(chunk, batch, input_tensor) -> output_tensor
        runs one chunk on one micro-batch; input_tensor is None on the first stage
    loss_func(output_tensor, batch) -> (loss_for_backward, reported_loss)
        on the last stage: the scalar to differentiate (already divided by the number of
        micro-batches, times the loss scale) and a detached value to report

Gradients accumulate locally over the micro-batches (DDP's no_sync); the data-parallel
reduction is started only by the last micro-batch's backward (with --overlap-grad-reduce) or
by finalize_model_grads afterwards; with sharded gradients (optim_grads, optim_grads_params)
every micro-batch's backward reduces them, and the schedule calls the chunk's `end_backward`
after each. Every schedule returns the reported losses of the last
stage's micro-batches (an empty list on other stages).
"""

from __future__ import annotations

import contextlib
import time

import torch

from parallel.pipeline.p2p import backward_from, free_sent_output
from parallel.timing import StepTimes, measure


def _no_sync(ddps, last: bool):
    if last:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for ddp in ddps:
        stack.enter_context(ddp.no_sync())
    return stack


def _end_backward(chunk) -> None:
    """A micro-batch's backward through chunk is done (sharded gradients are reduced now)."""
    end = getattr(chunk, "end_backward", None)
    if end is not None:
        end()


def forward_backward_no_pipelining(
    chunks,
    batches,
    forward_step,
    loss_func,
    *,
    forward_only: bool = False,
    times: StepTimes | None = None,
) -> list[torch.Tensor]:
    """One stage holds the whole model: forward and backward each micro-batch in turn.
    `times` gets the "forward-compute" and "backward-compute" seconds."""
    if len(chunks) != 1:
        raise ValueError("without pipelining the model is a single chunk")
    chunk = chunks[0]
    losses = []
    for index, batch in enumerate(batches):
        with _no_sync(chunks, last=index == len(batches) - 1):
            if forward_only:
                with torch.no_grad(), measure(times, "forward-compute"):
                    output = forward_step(chunk, batch, None)
                    losses.append(loss_func(output, batch)[1])
                continue
            with measure(times, "forward-compute"):
                output = forward_step(chunk, batch, None)
                loss, reported = loss_func(output, batch)
            with measure(times, "backward-compute"):
                loss.backward()
                _end_backward(chunk)
            losses.append(reported)
    return losses


# --- pipelined schedules -------------------------------------------------------------------


def warmup_forwards(kind: str, p: int, rank: int, m: int, v: int = 1) -> int:
    """Forwards (of chunk-micro-batches) stage `rank` runs before its first backward."""
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - rank - 1, m)
    total = m * v
    if m == p:
        return total  # all forwards, then all backwards
    return min((p - rank - 1) * 2 + (v - 1) * p, total)


def peak_in_flight(kind: str, p: int, rank: int, m: int, v: int = 1) -> int:
    """The most chunk-micro-batches whose activations stage `rank` holds at once (forward
    done, backward not yet): the warm-up forwards and the steady state's one more."""
    warmup, total = warmup_forwards(kind, p, rank, m, v), m * v
    return total if warmup >= total else warmup + 1


class _Stage:
    """One rank's bookkeeping: running chunks forward and backward. `stats` (optional) gets
    'peak_held', the most micro-batches whose activations were held at once (forward done,
    backward not yet), 'peak_output_bytes', the most bytes their output tensors held at once
    when a forward starts (sent outputs are freed: p2p.free_sent_output), and 'compute_s',
    the time spent in forward and backward. `times` (optional) gets the "forward-compute" and
    "backward-compute" seconds."""

    def __init__(self, chunks, batches, forward_step, loss_func, forward_only, stats, times=None):
        self.chunks, self.batches = chunks, batches
        self.forward_step, self.loss_func = forward_step, loss_func
        self.forward_only = forward_only
        self.losses: list[torch.Tensor] = []
        self.held = 0
        self.stats = stats if stats is not None else {}
        self.stats["peak_held"] = 0
        self.stats["peak_output_bytes"] = 0
        self.stats["compute_s"] = 0.0
        self.held_outputs: list[torch.Tensor] = []
        self.times = times

    def forward(self, chunk_index: int, microbatch: int, input_tensor, is_last_stage: bool):
        chunk, batch = self.chunks[chunk_index], self.batches[microbatch]
        held_bytes = sum(o.untyped_storage().nbytes() for o in self.held_outputs)
        self.stats["peak_output_bytes"] = max(self.stats["peak_output_bytes"], held_bytes)
        start = time.perf_counter()
        with torch.set_grad_enabled(not self.forward_only), measure(self.times, "forward-compute"):
            output = self.forward_step(chunk, batch, input_tensor)
            if is_last_stage:
                loss, reported = self.loss_func(output, batch)
                self.losses.append(reported)
                output = loss
        self.stats["compute_s"] += time.perf_counter() - start
        if not self.forward_only:
            self.held += 1
            self.stats["peak_held"] = max(self.stats["peak_held"], self.held)
            self.held_outputs.append(output)
        return output

    def backward(self, chunk_index: int, last_microbatch: bool, input_tensor, output, output_grad):
        """Backward of one micro-batch through one chunk; returns the gradient of its input.
        The chunk's DP reduction may start only in its last micro-batch's backward."""
        ddp = self.chunks[chunk_index]
        if hasattr(ddp, "is_last_microbatch"):
            ddp.is_last_microbatch = last_microbatch
        if input_tensor is not None:
            input_tensor.retain_grad()
        start = time.perf_counter()
        with measure(self.times, "backward-compute"):
            backward_from(output, output_grad)
            _end_backward(ddp)
        self.held_outputs = [o for o in self.held_outputs if o is not output]
        self.stats["compute_s"] += time.perf_counter() - start
        if hasattr(ddp, "is_last_microbatch"):
            ddp.is_last_microbatch = True
        self.held -= 1
        return input_tensor.grad if input_tensor is not None else None


def forward_backward_gpipe(
    chunks, batches, forward_step, loss_func, *, p2p, forward_only=False, stats=None, times=None
):
    """All forwards, then all backwards (the baseline: a stage holds all m micro-batches)."""
    stage = _Stage(chunks, batches, forward_step, loss_func, forward_only, stats, times)
    state, m = p2p.state, len(batches)
    saved = []
    for k in range(m):
        input_tensor = p2p.recv_forward(not state.is_first_stage)
        output = stage.forward(0, k, input_tensor, state.is_last_stage)
        p2p.send_forward(None if state.is_last_stage else output)
        free_sent_output(None if state.is_last_stage else output)
        if not forward_only:
            saved.append((input_tensor, output))
    if forward_only:
        return stage.losses
    for k in range(m):
        output_grad = p2p.recv_backward(not state.is_last_stage)
        input_tensor, output = saved.pop(0)
        grad = stage.backward(0, k == m - 1, input_tensor, output, output_grad)
        p2p.send_backward(None if state.is_first_stage else grad)
    return stage.losses


def forward_backward_1f1b(
    chunks, batches, forward_step, loss_func, *, p2p, forward_only=False, stats=None, times=None
):
    """One-forward-one-backward: p - rank - 1 warm-up forwards, then alternate, then drain.
    A stage never holds more than p - rank micro-batches of activations."""
    if forward_only:
        return forward_backward_gpipe(
            chunks,
            batches,
            forward_step,
            loss_func,
            p2p=p2p,
            forward_only=True,
            stats=stats,
            times=times,
        )
    stage = _Stage(chunks, batches, forward_step, loss_func, forward_only, stats, times)
    state, m = p2p.state, len(batches)
    first, last = state.is_first_stage, state.is_last_stage
    warmup = warmup_forwards("1f1b", state.pp_size, state.pp_rank, m)
    steady = m - warmup
    saved = []
    for k in range(warmup):
        input_tensor = p2p.recv_forward(not first)
        output = stage.forward(0, k, input_tensor, last)
        p2p.send_forward(None if last else output)
        free_sent_output(None if last else output)
        saved.append((input_tensor, output))
    input_tensor = p2p.recv_forward(not first) if steady else None
    for k in range(steady):
        output = stage.forward(0, warmup + k, input_tensor, last)
        output_grad = p2p.exchange(send_next=None if last else output, recv_next=not last)[1]
        free_sent_output(None if last else output)
        saved.append((input_tensor, output))
        held_input, held_output = saved.pop(0)
        grad = stage.backward(0, k == m - 1, held_input, held_output, output_grad)
        if k == steady - 1:
            p2p.send_backward(None if first else grad)
        else:
            input_tensor = p2p.exchange(send_prev=None if first else grad, recv_prev=not first)[0]
    for k in range(warmup):
        output_grad = p2p.recv_backward(not last)
        held_input, held_output = saved.pop(0)
        grad = stage.backward(0, steady + k == m - 1, held_input, held_output, output_grad)
        p2p.send_backward(None if first else grad)
    return stage.losses


class _Mailbox:
    """The interleaved schedule's transfers, filed into per-chunk queues on arrival.

    `forward(output, into)` sends an output to the next stage and receives the next forward
    input into the list `into` (None: nothing to receive); `backward(grad, into)` likewise
    towards the previous stage. Without overlap, what a schedule step asks for is posted as
    one batch by `flush` and waited for at once. With overlap each is posted at once and
    waited for only by `settle` before the compute that needs it, so a forward's transfers run
    during the following backward and vice versa."""

    def __init__(self, p2p, overlap: bool):
        self.p2p, self.overlap = p2p, overlap
        self.staged: dict = {}
        self.into: dict = {}
        self.waiting: list = []  # (direction, Pending, into)

    def forward(self, output, into: list | None) -> None:
        self._add("forward", into, send_next=output, recv_prev=into is not None)

    def backward(self, input_grad, into: list | None) -> None:
        self._add("backward", into, send_prev=input_grad, recv_next=into is not None)

    def _add(self, direction: str, into, **transfers) -> None:
        if self.overlap:
            self.waiting.append((direction, self.p2p.post(**transfers), into))
            free_sent_output(transfers.get("send_next"))
            return
        self.staged.update(transfers)
        self.into[direction] = into

    def flush(self) -> None:
        if self.overlap or not self.staged:
            return
        pending = self.p2p.post(**self.staged)
        free_sent_output(self.staged.get("send_next"))
        self.waiting = [(direction, pending, into) for direction, into in self.into.items()]
        self.staged, self.into = {}, {}
        self.settle()

    def settle(self, direction: str | None = None) -> None:
        """Wait for the transfers in flight in `direction` (all when None), in posting order."""
        still = []
        for entry in self.waiting:
            kind, pending, into = entry
            if direction not in (None, kind):
                still.append(entry)
                continue
            from_prev, from_next = pending.wait()
            if into is not None:
                into.append(from_prev if kind == "forward" else from_next)
        self.waiting = still


def forward_backward_interleaved(
    chunks,
    batches,
    forward_step,
    loss_func,
    *,
    p2p,
    forward_only=False,
    stats=None,
    overlap_p2p=False,
    times=None,
):
    """Interleaved 1F1B: each rank holds v model chunks (virtual stages); global chunk order is
    chunk 0 of every rank, then chunk 1 of every rank, ... Micro-batches go through in groups
    of p; the bubble shrinks to (p - 1) / v of a chunk's time. Needs m divisible by p.
    `overlap_p2p` waits for each transfer only when its result is needed."""
    state, p, v, m = p2p.state, p2p.state.pp_size, len(chunks), len(batches)
    if m % p:
        raise ValueError(
            f"interleaved pipelining needs the micro-batches per step ({m}) to be a multiple of "
            f"pipeline-model-parallel-size {p}"
        )
    stage = _Stage(chunks, batches, forward_step, loss_func, forward_only, stats, times)
    stage.stats["computes_overlapped"] = 0  # computes started with transfers in flight
    box = _Mailbox(p2p, overlap_p2p)
    first, last = state.is_first_stage, state.is_last_stage
    rank, total = state.pp_rank, m * v

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def first_virtual(c: int) -> bool:
        return first and c == 0

    def last_virtual(c: int) -> bool:
        return last and c == v - 1

    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    output_grads = [[] for _ in range(v)]

    def forward(k: int):
        box.settle("forward")
        stage.stats["computes_overlapped"] += bool(box.waiting)
        c = chunk_of(k, True)
        if first_virtual(c) and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)  # the first virtual stage starts from the embedding
        output = stage.forward(c, microbatch_of(k), inputs[c][-1], last_virtual(c))
        if forward_only:
            inputs[c].pop()
        else:
            outputs[c].append(output)
        return None if last_virtual(c) else output

    def backward(k: int):
        box.settle("backward")
        stage.stats["computes_overlapped"] += bool(box.waiting)
        c = chunk_of(k, False)
        if last_virtual(c) and not output_grads[c]:
            output_grads[c].append(None)  # the loss is differentiated directly
        last_mb = microbatch_of(k) == m - 1
        grad = stage.backward(
            c, last_mb, inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0)
        )
        return None if first_virtual(c) else grad

    warmup = total if forward_only else warmup_forwards("interleaved", p, rank, m, v)
    steady = total - warmup

    if first:
        inputs[0].append(None)
    else:
        box.forward(None, inputs[0])
        box.flush()
    for k in range(warmup):
        output = forward(k)
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first and next_chunk == 0) and k < total - 1
        box.forward(output, inputs[next_chunk] if recv_prev else None)
        if k == warmup - 1 and not forward_only and steady > 0:
            box.backward(None, None if last else output_grads[v - 1])
        box.flush()

    for k in range(steady):
        forward_k, backward_k = warmup + k, k
        # The first stage runs p - 1 steps ahead of the last, and vice versa for backward,
        # so what arrives next belongs to the chunk those neighbours are working on.
        recv_prev = k < steady - 1
        if first:
            next_forward = chunk_of(forward_k - (p - 1), True)
            recv_prev = recv_prev and next_forward != v - 1
            next_forward += 1
        else:
            next_forward = chunk_of(forward_k + 1, True)
        recv_next = True
        if last:
            next_backward = chunk_of(backward_k - (p - 1), False)
            recv_next = next_backward != 0
            next_backward -= 1
        else:
            next_backward = chunk_of(backward_k + 1, False)
        box.forward(forward(forward_k), inputs[next_forward] if recv_prev else None)
        box.backward(backward(backward_k), output_grads[next_backward] if recv_next else None)
        box.flush()

    if not forward_only:
        if steady == 0:
            box.backward(None, None if last else output_grads[v - 1])
            box.flush()
        for k in range(steady, total):
            next_backward = chunk_of(k + 1, False)
            recv_next = not (last and next_backward == v - 1) and k < total - 1
            box.backward(backward(k), output_grads[next_backward] if recv_next else None)
            box.flush()
    box.settle()
    return stage.losses


SCHEDULES = {
    "gpipe": forward_backward_gpipe,
    "1f1b": forward_backward_1f1b,
    "interleaved": forward_backward_interleaved,
}


def get_schedule(
    state,
    *,
    virtual_size: int = 1,
    kind: str | None = None,
    tensor_shape=None,
    dtype=None,
    stats: dict | None = None,
    overlap_p2p: bool = False,
    times: StepTimes | None = None,
):
    """The schedule for a layout: no pipelining for PP=1, else 1F1B (interleaved when the
    model has virtual stages), or `kind` ('gpipe', '1f1b', 'interleaved') explicitly.
    `overlap_p2p` (interleaved only) lets transfers run during compute. `times`: gets the
    seconds of forward and backward compute and of waits for pipeline transfers."""
    import functools

    from parallel.pipeline.p2p import P2P

    if state.pp_size == 1 and virtual_size == 1:
        return functools.partial(forward_backward_no_pipelining, times=times)
    kind = kind or ("interleaved" if virtual_size > 1 else "1f1b")
    if (kind == "interleaved") != (virtual_size > 1):
        raise ValueError(f"schedule {kind} does not fit {virtual_size} model chunks per rank")
    p2p = P2P(state, tuple(tensor_shape), dtype, times)
    if kind != "interleaved":
        if overlap_p2p:
            raise ValueError("overlapping pipeline transfers needs the interleaved schedule")
        return functools.partial(SCHEDULES[kind], p2p=p2p, stats=stats, times=times)
    return functools.partial(
        SCHEDULES[kind], p2p=p2p, stats=stats, overlap_p2p=overlap_p2p, times=times
    )
