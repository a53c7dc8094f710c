"""One training iteration: an optimizer step over the global batch, or a skipped one.

The step is skipped (and counted) when the loss or the gradient is NaN/Inf or, with
--skip-spike-batches, the loss is a spike (z-score over a window of recent losses). A skipped
step does not advance the learning-rate schedule; the "lr" logged is the one the iteration's
update used or would have. With --rerun-on-nan a NaN/Inf step is first computed again from the
same state and data (engine/train/rerun.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.train import faults
from engine.train.dataset_gradients import cosines, dataset_gradients, pcgrad
from engine.train.rerun import StepSnapshot, local_gradients_finite, ranks_without, report
from engine.train.state import Run
from engine.train.step import StepHooks, train_step


@dataclass(frozen=True)
class IterationResult:
    """What an iteration did, as the log lines read it."""

    lm_loss: float
    lr: float
    updated: bool
    grad_norm: float | None  # None when the update was not taken
    loss_scale: float | None  # fp16's dynamic loss scale
    nan: bool  # a NaN/Inf loss or gradient (counted towards --exit-on-nan-count)
    batch_size: int  # the global batch
    spike_z: float | None = None  # the loss's z-score when it was a spike
    part_norms: dict[str, float] | None = None  # --log-grad-norms-interval
    gradient_noise_scale: float | None = None  # --log-gradient-noise-scale (smoothed)
    local_grad_norm: float | None = None  # its input: the DP ranks' own gradients' rms norm
    domain_parts: list[float] | None = None  # a blend's losses by dataset (loss.py)
    num_zeros: int | None = None  # --log-num-zeros-in-grad
    params_norm: float | None = None  # --log-params-norm
    moe: object = None  # an MoE model's engine.monitor.moe_metrics.MoEStepMetrics
    mtp_losses: list[float] | None = None  # multi-token prediction's, one per depth
    grad_cosines: dict[str, float] | None = None  # --log-gradient-cosine-interval
    pcgrad_projections: int | None = None  # --pcgrad: projections made in the step
    update_ratios: dict[str, float] | None = None  # --log-update-to-weight-ratios
    activations: dict[str, float] | None = None  # --log-activation-stats


def train_iteration(run: Run, batches: list[dict], global_batch: int | None = None):
    """One optimizer step over `batches` (this rank's micro-batches of a global batch of
    `global_batch` samples, by default the run's final one), or a skipped step. Collective on
    every rank; every rank decides the same. Returns an IterationResult."""
    global_batch = global_batch or run.batches.final
    rank, iteration = run.state.rank, run.progress.counters.iteration + 1
    times = run.features.times
    first = run.progress.counters.consumed_samples
    faults.before_iteration(
        rank, iteration, batches, run.cfg.model.vocab_size, times, (first, first + global_batch)
    )
    spike: dict[str, float | bool | None] = {"z": None, "attempted": False}

    def should_step(loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        spike["z"] = run.spikes.check(loss)
        spike["attempted"] = spike["z"] is None or not run.cfg.exit.skip_spike_batches
        return bool(spike["attempted"])

    # The loss decides the step only where it can: skipping spike batches, or fp16 (a
    # non-finite loss must not move the loss scale). Elsewhere a non-finite loss gives a
    # non-finite gradient norm, which skips the update anyway, and the loss is read after
    # the update: one wait for the device per step.
    early = run.cfg.exit.skip_spike_batches or run.optimizer.grad_scaler is not None
    reruns = run.cfg.resilience.reruns_non_finite  # (not with fp16's scaler: checks.py)
    snapshot = StepSnapshot(run) if reruns else None
    local = {"finite": torch.ones(1, device=run.state.device)}

    def after_backward(first: bool) -> None:
        if first:  # an injected fault is transient: it does not come back in a rerun
            faults.after_backward(rank, iteration, run.chunks)
        if reruns:
            local["finite"] = local_gradients_finite(run.chunks, run.state.device)

    features = run.features.at(iteration)
    grad_cosines, surgery, projections = _dataset_gradients(run, batches, features, iteration)

    def step(first: bool):
        hooks = StepHooks(
            after_backward=lambda: after_backward(first),
            should_step=should_step if early else None,
            before_update=run.checkpointer.wait_for_copy if run.checkpointer else None,
            gradient=(lambda: surgery) if surgery is not None else None,
        )
        out = train_step(
            run.chunks,
            run.optimizer,
            run.scheduler,
            batches,
            run.state,
            run.schedule,
            features=features,
            hooks=hooks,
            samples=global_batch,
            reduction=run.loss_reduction,
        )
        if not early:
            spike["z"], spike["attempted"] = run.spikes.check(out.loss), True
        # An attempted step that did not update had a non-finite gradient (with fp16 that is
        # a loss-scale overflow, which the scaler handles and is not counted).
        bad = spike["attempted"] and not out.updated and run.optimizer.grad_scaler is None
        return out, not math.isfinite(out.loss) or bool(bad)

    out, nan = step(first=True)
    if reruns and nan and not out.updated:  # (a step that updated changed the state)
        ranks = ranks_without(local["finite"], run.state)
        snapshot.restore(run)
        spike.update(z=None, attempted=False)
        out, nan = step(first=False)
        consumed = run.progress.counters.consumed_samples
        run.writer.print(report(iteration, ranks, out.loss, not nan, (consumed, global_batch)))
    faults.after_update(rank, iteration, run.chunks)
    noise_scale = local_norm = None
    if features.noise_scale is not None and out.grad_norm is not None:
        local_norm = math.sqrt(out.local_grad_squares)
        own_batch = global_batch // run.state.dp_size
        noise_scale = features.noise_scale.update(
            out.local_grad_squares, own_batch, out.grad_norm**2, global_batch
        )
    return IterationResult(
        lm_loss=out.loss,
        lr=out.lr,
        updated=out.updated,
        grad_norm=out.grad_norm,
        loss_scale=out.loss_scale,
        nan=nan,
        batch_size=global_batch,
        spike_z=spike["z"],
        part_norms=out.part_norms,
        gradient_noise_scale=noise_scale,
        local_grad_norm=local_norm,
        domain_parts=out.domain_parts,
        num_zeros=out.num_zeros,
        params_norm=out.params_norm,
        moe=out.moe,
        mtp_losses=out.mtp_losses,
        grad_cosines=grad_cosines,
        pcgrad_projections=projections,
        update_ratios=out.update_ratios,
        activations=out.activations,
    )


def _dataset_gradients(run: Run, batches: list[dict], features, iteration: int):
    """(cosines, the surgery's gradient, its projection count) where the features ask for
    them at this iteration (engine/train/dataset_gradients.py); Nones elsewhere."""
    wants_cosines, wants_surgery = features.dataset_gradients_at(iteration)
    if not (wants_cosines or wants_surgery):
        return None, None, None
    found = dataset_gradients(run, batches)
    grad_cosines = cosines(run, found) if wants_cosines else None
    if not wants_surgery:
        return grad_cosines, None, None
    if len(found.names) < 2:  # one dataset in the step: nothing to project
        return grad_cosines, None, 0
    surgery, projections = pcgrad(run, found, iteration)
    return grad_cosines, surgery, projections
