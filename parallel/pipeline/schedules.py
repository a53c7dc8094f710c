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

Pipelined schedules are tables of actions per rank (parallel/pipeline/tables.py: gpipe, 1f1b,
interleaved, zb-h1, zb-v, dualpipe-v), validated (parallel/pipeline/validate.py) and run by one
runtime (parallel/pipeline/runtime.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from parallel.pipeline.runtime import TableRuntime
from parallel.pipeline.tables import (
    V_SHAPED,
    Table,
    build_table,
    schedule_name,
    warmup_forwards,
)
from parallel.pipeline.validate import validate
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


# --- pipelined schedules: a table of actions per rank, run by one runtime ------------------


def peak_in_flight(
    kind: str, p: int, rank: int, m: int, v: int = 1, group: int | None = None
) -> int:
    """The most chunk-micro-batches whose activations rank `rank` holds at once (forward
    done, backward not yet) under schedule `kind`: the warm-up forwards and the steady
    state's one more (zb-h1 holds back up to `rank` weight gradients: p in all; zb-v's V
    holds 2p half-size chunks, dualpipe-v's 2p + 1). tests/test_pipeline_tables.py checks it
    against the tables."""
    total = m * v
    if kind == "zb-h1":
        return min(p, m)
    if kind == "zb-v":
        return min(2 * p, total)
    if kind == "dualpipe-v":  # its steady pairs hold one more
        return min(2 * p + 1, total)
    warmup = warmup_forwards(kind, p, rank, m, v, group)
    return total if warmup >= total else warmup + 1


@functools.lru_cache(maxsize=64)
def checked_table(kind: str, p: int, v: int, m: int, group: int | None = None) -> Table:
    """The schedule's table, validated once (parallel/pipeline/validate.py: its transfer
    plans included, under gloo's and NCCL's rules)."""
    table = build_table(kind, p, v, m, group)
    validate(table)
    return table


def forward_backward_pipelined(
    chunks,
    batches,
    forward_step,
    loss_func,
    *,
    kind: str,
    p2p,
    forward_only: bool = False,
    stats: dict | None = None,
    overlap_p2p: bool = False,
    times: StepTimes | None = None,
    trace: bool = False,
    group: int | None = None,
) -> list[torch.Tensor]:
    """Schedule `kind` over this step's micro-batches: its table run by the runtime
    (`group`: interleaved's micro-batch group)."""
    table = checked_table(kind, p2p.state.pp_size, len(chunks), len(batches), group)
    runtime = TableRuntime(
        table, chunks, batches, forward_step, loss_func, p2p=p2p, forward_only=forward_only,
        stats=stats, times=times, overlap=overlap_p2p, trace=trace,
    )  # fmt: skip
    return runtime.run()


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
    trace: bool = False,
    microbatch_group: int | None = None,
):
    """The schedule for a layout: no pipelining for PP=1, else 1F1B (interleaved when the
    model has virtual stages), or `kind` (a name of parallel/pipeline/tables.py) explicitly.
    `overlap_p2p` lets transfers run during compute. `times`: gets the seconds of forward
    and backward compute and of waits for pipeline transfers; `trace`: stats get 'events'.
    `microbatch_group`: the interleaved schedule's micro-batch group (default p)."""
    from parallel.pipeline.p2p import P2P

    if state.pp_size == 1 and virtual_size == 1:
        return functools.partial(forward_backward_no_pipelining, times=times)
    kind = schedule_name(kind, virtual_size)
    chunks_needed = "2 or more" if kind == "interleaved" else "2" if kind in V_SHAPED else "1"
    fits = virtual_size == 2 if kind in V_SHAPED else (virtual_size > 1) == (kind == "interleaved")
    if not fits:
        raise ValueError(
            f"schedule {kind} runs {chunks_needed} model chunks per rank, not {virtual_size}"
        )
    p2p = P2P(state, tuple(tensor_shape), dtype, times)
    return functools.partial(
        forward_backward_pipelined, kind=kind, p2p=p2p, stats=stats, overlap_p2p=overlap_p2p,
        times=times, trace=trace, group=microbatch_group,
    )  # fmt: skip
