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
by finalize_model_grads afterwards. Every schedule returns the reported losses of the last
stage's micro-batches (an empty list on other stages).
"""

from __future__ import annotations

import contextlib

import torch


def _no_sync(ddps, last: bool):
    if last:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for ddp in ddps:
        stack.enter_context(ddp.no_sync())
    return stack


def forward_backward_no_pipelining(
    chunks, batches, forward_step, loss_func, *, forward_only: bool = False
) -> list[torch.Tensor]:
    """One stage holds the whole model: forward and backward each micro-batch in turn."""
    if len(chunks) != 1:
        raise ValueError("without pipelining the model is a single chunk")
    chunk = chunks[0]
    losses = []
    for index, batch in enumerate(batches):
        with _no_sync(chunks, last=index == len(batches) - 1):
            if forward_only:
                with torch.no_grad():
                    output = forward_step(chunk, batch, None)
                    losses.append(loss_func(output, batch)[1])
                continue
            output = forward_step(chunk, batch, None)
            loss, reported = loss_func(output, batch)
            loss.backward()
            losses.append(reported)
    return losses
