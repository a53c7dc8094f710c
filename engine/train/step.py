"""One training (or evaluation) step of the GPT model over a global batch.

The engine's side of the pipeline schedules: how a model chunk runs on a micro-batch
(`forward_step`) and how the last stage turns per-token losses into the scalar to
differentiate (`make_loss_func`). `train_step` then does: zero grads, the schedule over the
micro-batches, finalize_model_grads (DP reduction, TP partial grads, tied embeddings across
pipeline stages), the learning rate, and the optimizer step (the learning-rate schedule
advances only when that step updates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import group_size
from parallel.context_parallel.attention import split_sequence
from parallel.grads import finalize_model_grads
from parallel.pipeline.schedules import forward_backward_no_pipelining
from parallel.timing import measure


def forward_step(chunk, batch: dict, input_tensor: torch.Tensor | None) -> torch.Tensor:
    """Run one model chunk: tokens on the first stage, labels on the last."""
    module = chunk.module if hasattr(chunk, "module") else chunk
    tokens = batch["tokens"] if module.pre_process else None
    labels = batch["labels"] if module.post_process else None
    return chunk(tokens=tokens, labels=labels, hidden=input_tensor)


def make_loss_func(
    num_microbatches: int, loss_scale: float = 1.0, cp_group=None, num_domains: int = 0
):
    """Per-token losses [b, s] -> (mean / num_microbatches * loss_scale, detached mean).
    A (loss, z-loss) pair from the model adds the z-loss to what is differentiated only.

    With `num_domains` (a blend whose batches say each sample's dataset, `domain`), the
    detached value is [mean, s_0 .. s_{D-1}, w_0 .. w_{D-1}]: w_d is the share of the mean's
    token weight that dataset d's tokens carry and s_d their weighted loss, so s_d / w_d is
    dataset d's loss and the s_d add up to the mean (see `domain_losses`).

    Under context parallelism (cp_group) each rank holds part of every sequence: its "mean"
    is its share of the micro-batch's mean (its tokens' sum over the whole micro-batch's token
    count), so the shares of a CP group add up to the mean. What is differentiated is scaled
    by the CP size, because gradients are averaged over DP x CP while the CP ranks' parts
    must add up."""
    cp_size = group_size(cp_group)

    def loss_func(output, batch: dict):
        per_token, z_term = output if isinstance(output, tuple) else (output, None)
        mask = batch.get("loss_mask")
        weights = None if mask is None else mask.to(per_token.dtype)
        if cp_size == 1:
            count = per_token.numel() if weights is None else weights.sum().clamp(min=1.0)
            loss, reported = _mean_loss(per_token, z_term, mask, num_microbatches, loss_scale)
        else:
            if weights is None:
                count = float(per_token.numel() * cp_size)
            else:
                total_count = weights.sum().detach().clone()
                dist.all_reduce(total_count, group=cp_group)
                count = total_count.clamp(min=1.0)

            def share_of(values):
                return (values if weights is None else values * weights).sum() / count

            share = share_of(per_token)
            total = share if z_term is None else share + share_of(z_term)
            loss, reported = total * (cp_size * loss_scale / num_microbatches), share.detach()
        if num_domains and "domain" not in batch:
            raise ValueError("per-dataset losses asked for, but the batch says no sample's dataset")
        if num_domains:
            parts = _domain_parts(per_token.detach(), weights, count, batch["domain"], num_domains)
            reported = torch.cat([reported.reshape(1), parts])
        return loss, reported

    return loss_func


def _mean_loss(per_token, z_term, mask, num_microbatches: int, loss_scale: float):
    def mean_of(values):
        if mask is None:
            return values.mean()
        weights = mask.to(values.dtype)
        return (values * weights).sum() / weights.sum().clamp(min=1.0)

    mean = mean_of(per_token)
    total = mean if z_term is None else mean + mean_of(z_term)
    return total * (loss_scale / num_microbatches), mean.detach()


def _domain_parts(per_token, weights, count, domain, num_domains: int) -> torch.Tensor:
    """[s_0 .. s_{D-1}, w_0 .. w_{D-1}] of one micro-batch (see make_loss_func)."""
    token_weights = torch.ones_like(per_token) if weights is None else weights
    token_weights = token_weights / count
    onehot = torch.nn.functional.one_hot(domain, num_domains).to(per_token.dtype)  # [b, D]
    losses = (per_token * token_weights).sum(dim=1) @ onehot
    shares = token_weights.sum(dim=1) @ onehot
    return torch.cat([losses, shares])


def domain_losses(values: list[float], names) -> dict[str, tuple[float, float]]:
    """{name: (loss, share)} from a step's summed [s_0 .., w_0 ..] (see make_loss_func): the
    shares add up to 1 and sum(share * loss) is the overall loss. A dataset with no tokens in
    the batch has no entry."""
    count = len(names)
    out = {}
    for d, name in enumerate(names):
        loss_sum, share = values[d], values[count + d]
        if share > 0:
            out[name] = (loss_sum / share, share)
    return out


def context_parallel_batches(batches: list[dict], state) -> list[dict]:
    """This CP rank's two load-balanced chunks of every sequence in the micro-batches
    ([b, s] tensors split along s); the batches themselves when there is no CP."""
    if state.cp_size == 1:
        return batches
    # [b, s] tensors are cut along the sequence; a per-sample `domain` [b] stays whole
    rank, size = state.cp_rank, state.cp_size
    return [
        {k: split_sequence(v, 1, size, rank) if v.dim() > 1 else v for k, v in b.items()}
        for b in batches
    ]


@dataclass
class StepOutput:
    loss: float  # mean over the global batch, the same on every rank
    grad_norm: float | None  # None when the step was not taken
    lr: float
    updated: bool
    loss_scale: float | None
    part_norms: dict[str, float] | None = None  # with norm_parts: each part's gradient norm
    local_grad_squares: float | None = None  # with local_squares: mean |own gradient|^2
    domain_parts: list[float] | None = None  # with num_domains: [s_0 .., w_0 ..]


def run_schedule(
    chunks, batches, schedule, forward_only=False, loss_scale=1.0, state=None, num_domains=0
) -> list[torch.Tensor]:
    """The schedule over the micro-batches (whole sequences: under context parallelism, given
    `state`, each CP rank runs its chunks of them)."""
    cp_group = None
    if state is not None:
        batches, cp_group = context_parallel_batches(batches, state), state.cp_group
    loss_func = make_loss_func(len(batches), loss_scale, cp_group, num_domains)
    schedule = schedule or forward_backward_no_pipelining
    return schedule(chunks, batches, forward_step, loss_func, forward_only=forward_only)


def shared_loss(losses: list[torch.Tensor], state, num_domains: int = 0) -> list[float]:
    """Mean of the last stage's micro-batch losses over the DP ranks (the sum of the CP
    ranks' shares), made known to every rank (the other pipeline stages contribute nothing
    to the sum): [loss], or with `num_domains` [loss, s_0 .., w_0 ..] (make_loss_func).
    Collective on all ranks."""
    value = torch.zeros(1 + 2 * num_domains, dtype=torch.float64, device=state.device)
    if losses:
        value += torch.stack([x.reshape(-1) for x in losses]).double().mean(dim=0)
    if state.dp_cp_group is not None:
        dist.all_reduce(value, group=state.dp_cp_group)
        value /= state.dp_size
    if state.pp_group is not None:
        dist.all_reduce(value, group=state.pp_group)
    return value.tolist()


def eval_step(chunks, batches, state, schedule=None, num_domains: int = 0) -> list[float]:
    """Mean loss of the batches, without gradients, on every rank: [loss] or, with
    `num_domains`, [loss, s_0 .., w_0 ..] (make_loss_func)."""
    for chunk in chunks:
        chunk.eval()
    try:
        losses = run_schedule(
            chunks, batches, schedule, forward_only=True, state=state, num_domains=num_domains
        )
    finally:
        for chunk in chunks:
            chunk.train()
    return shared_loss(losses, state, num_domains)


def train_step(
    chunks,
    optimizer,
    scheduler,
    batches,
    state,
    schedule=None,
    *,
    after_backward=None,
    should_step: Callable[[float], bool] | None = None,
    before_update=None,
    samples: int | None = None,
    norm_parts=None,
    local_squares=None,
    num_domains: int = 0,
    times=None,
) -> StepOutput:
    """Zero grads, forward/backward every micro-batch, reduce, set the learning rate, step.
    should_step(loss) can decline the update (it must decide the same on every rank; the loss
    it gets is); after_backward() runs between backward and the gradient reduction;
    before_update() right before the weights and optimizer state change.
    A non-finite gradient norm skips the update inside the optimizer. The scheduler advances
    only when the update is applied, by `samples` (the global batch; default the scheduler's).
    `norm_parts` (parallel.data_parallel.optimizer.NormParts): also the gradient norm of each part;
    `local_squares` (engine.monitor.noise_scale.LocalGradSquares): also the DP ranks' mean squared
    norm of their own gradients, before the reduction. `num_domains`: the loss of each
    dataset of a blend (make_loss_func), in `domain_parts`. `times` (parallel.timing.StepTimes)
    gets the seconds of the gradient reductions ("grads-sync"), of making the loss known to
    every rank ("loss-sync") and of the optimizer step ("optimizer"); the schedule counts its
    own parts.
    Collective on all ranks.
    """
    with measure(times, "optimizer"):
        optimizer.zero_grad()
    scale = optimizer.grad_scaler.scale if optimizer.grad_scaler is not None else 1.0
    if local_squares is not None:
        local_squares.attach(state.device)
    losses = run_schedule(
        chunks, batches, schedule, loss_scale=scale, state=state, num_domains=num_domains
    )
    if after_backward is not None:
        after_backward()
    shared = [w for c in chunks if (w := c.module.shared_embedding_weight()) is not None]
    with measure(times, "grads-sync"):
        finalize_model_grads(chunks, state.tp_group, state.embedding_group, shared)
    with measure(times, "grads-sync"):  # (the noise scale's reductions of the local norms)
        own = local_squares.detach(state, scale) if local_squares is not None else None
    with measure(times, "loss-sync"):
        loss, *parts = shared_loss(losses, state, num_domains)
    parts = parts or None
    with measure(times, "optimizer"):
        lr = scheduler.apply(optimizer)
    loss_scale = optimizer.grad_scaler.scale if optimizer.grad_scaler is not None else None
    if should_step is not None and not should_step(loss):
        return StepOutput(loss, None, lr, False, loss_scale, None, own, parts)
    if before_update is not None:
        with measure(times, "save-checkpoint"):  # an asynchronous save's copy still running
            before_update()
    with measure(times, "optimizer"):
        result = optimizer.step(norm_parts) if norm_parts is not None else optimizer.step()
    if result.updated:
        # As Megatron-LM: the schedule moves on only after an update is applied, so a skipped
        # one (non-finite gradient, fp16 overflow, declined above) is retried at the same LR.
        scheduler.advance(samples)
    norm = result.grad_norm if math.isfinite(result.grad_norm) else None
    return StepOutput(
        loss, norm, lr, result.updated, result.loss_scale, result.part_norms, own, parts
    )
