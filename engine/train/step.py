"""One training (or evaluation) step of the GPT model over a global batch.

The engine's side of the pipeline schedules: how a model chunk runs on a micro-batch
(`forward_step`; the loss is engine/train/loss.py's). `train_step` then does: zero grads, the
schedule over the micro-batches, finalize_model_grads (DP reduction, TP partial grads, tied
embeddings across pipeline stages), the learning rate, and the optimizer step (the
learning-rate schedule advances only when that step updates). What a step measures besides
(`StepFeatures`) and where the run steps in (`StepHooks`) are typed values made once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from engine.data.multi_token import multi_token_targets
from engine.model.moe.router import routers_of
from engine.model.multi_token import TARGET_KEYS
from engine.monitor.noise_scale import LocalGradSquares, NoiseScale
from engine.ops.fp8.apply import delayed_states
from engine.ops.fp8.delayed import update_delayed_scales
from engine.train.loss import LossReduction, make_loss_func, per_token_count
from parallel.comm import group_size
from parallel.context_parallel.chunks import context_parallel_batches
from parallel.data_parallel.optimizer import NormParts
from parallel.grads import finalize_model_grads
from parallel.pipeline.schedules import forward_backward_no_pipelining
from parallel.timing import StepTimes, measure


@dataclass(frozen=True)
class StepFeatures:
    """The optional measurements of the steps, chosen once at set-up: where the time goes
    (`times`: the gradient reductions as "grads-sync", making the loss known as "loss-sync",
    the optimizer as "optimizer"; the schedule counts its own parts), each part's gradient
    norm (`norm_parts`, every `norm_parts_interval` iterations), the data-parallel ranks'
    own gradients for the noise scale (`local_squares`, smoothed by `noise_scale`), the
    loss of each dataset of a blend (`domain_names`), the gradient's zeros (`num_zeros`) and
    the parameters' norm after the update (`params_norm`)."""

    times: StepTimes | None = None
    norm_parts: NormParts | None = None
    norm_parts_interval: int | None = None  # None: at every step
    local_squares: LocalGradSquares | None = None
    noise_scale: NoiseScale | None = None
    domain_names: tuple[str, ...] = ()
    num_zeros: bool = False  # --log-num-zeros-in-grad
    params_norm: bool = False  # --log-params-norm
    # an MoE model's measurements: chunks -> engine.monitor.moe_metrics.MoEStepMetrics
    moe_metrics: Callable | None = None
    # a blend's datasets' gradients (engine/train/dataset_gradients.py): their cosines every
    # this many iterations (whole and per part of `cosine_parts`), and --pcgrad at every step
    gradient_cosine_interval: int | None = None
    cosine_parts: NormParts | None = None
    pcgrad: bool = False
    # the health signals measured every `health_interval` iterations (the log interval):
    # each part's |update| / |weight| (`update_parts`) and the layers' output statistics
    update_parts: NormParts | None = None
    activation_stats: object = None  # engine.monitor.activation_stats.ActivationStats
    health_interval: int | None = None

    def dataset_gradients_at(self, iteration: int) -> tuple[bool, bool]:
        """(cosines, surgery) wanted at that iteration."""
        every = self.gradient_cosine_interval
        return bool(every) and iteration % every == 0, self.pcgrad

    @property
    def num_domains(self) -> int:
        return len(self.domain_names)

    def at(self, iteration: int) -> StepFeatures:
        """The features of that iteration (the part norms only where their interval falls)."""
        out, every = self, self.norm_parts_interval
        if self.norm_parts is not None and every is not None and iteration % every:
            out = replace(out, norm_parts=None)
        every = self.health_interval
        if every and iteration % every:
            out = replace(out, update_parts=None, activation_stats=None)
        return out


@dataclass(frozen=True)
class StepHooks:
    """Where the run steps into a training step: `after_backward()` between backward and
    the gradient reduction; `should_step(loss)` may decline the update (it must decide the
    same on every rank; the loss it gets is); `before_update()` right before the weights and
    optimizer state change; `gradient()`, the gradient to step with instead of the reduced
    one (as the optimizer's pieces hold it: --pcgrad's)."""

    after_backward: Callable[[], None] | None = None
    should_step: Callable[[float], bool] | None = None
    before_update: Callable[[], None] | None = None
    gradient: Callable[[], list[torch.Tensor]] | None = None


@dataclass(frozen=True)
class StepResult:
    """What one training step did."""

    loss: float  # mean over the global batch, the same on every rank
    grad_norm: float | None  # None when the step was not taken
    lr: float
    updated: bool
    loss_scale: float | None
    part_norms: dict[str, float] | None = None  # with norm_parts: each part's gradient norm
    local_grad_squares: float | None = None  # with local_squares: mean |own gradient|^2
    domain_parts: list[float] | None = None  # with domains: [s_0 .., w_0 ..] (loss.py)
    num_zeros: int | None = None  # with num_zeros, of an update taken
    params_norm: float | None = None  # with params_norm
    moe: object = None  # with moe_metrics: its MoEStepMetrics
    mtp_losses: list[float] | None = None  # multi-token prediction's depths' losses
    update_ratios: dict[str, float] | None = None  # with update_parts, of an update taken
    activations: dict[str, float] | None = None  # with activation_stats


def _module(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _mtp_depths(chunk) -> int:
    """The multi-token-prediction depths of the model a chunk is part of (0: none)."""
    return getattr(getattr(_module(chunk), "config", None), "mtp_depths", 0)


def forward_step(chunk, batch: dict, input_tensor: torch.Tensor | None) -> torch.Tensor:
    """Run one model chunk: tokens on the first stage, labels on the last, the samples'
    positions and documents on every stage where the run computes them (engine/data/
    documents.py's Packing), and multi-token prediction's targets where its layers are."""
    module = _module(chunk)
    tokens = batch["tokens"] if module.pre_process else None
    labels = batch["labels"] if module.post_process else None
    positions, documents = batch.get("position_ids"), batch.get("document_ids")
    extra = {}
    if getattr(module, "mtp", None) is not None and "mtp_tokens" in batch:
        extra["mtp_targets"] = {key: batch[key] for key in TARGET_KEYS}
    return chunk(
        tokens=tokens,
        labels=labels,
        hidden=input_tensor,
        position_ids=positions,
        document_ids=documents,
        **extra,
    )


def run_schedule(
    chunks,
    batches,
    schedule,
    forward_only=False,
    loss_scale=1.0,
    state=None,
    num_domains=0,
    reduction: LossReduction | None = None,
    only_domain: int | None = None,
) -> list[torch.Tensor]:
    """The schedule over the micro-batches (whole sequences: under context parallelism, given
    `state`, each CP rank runs its chunks of them); `reduction`: how the token losses become
    the loss (loss.py; by default each micro-batch's mean); `only_domain`: a blend's dataset
    whose tokens alone are differentiated (loss.py)."""
    return _counted_schedule(
        chunks, batches, schedule, forward_only, loss_scale, state, num_domains, reduction,
        only_domain,
    )[0]  # fmt: skip


def _counted_schedule(
    chunks, batches, schedule, forward_only, loss_scale, state, num_domains, reduction,
    only_domain=None,
):  # fmt: skip
    """run_schedule's losses, and the global batch's count of tokens that carry loss (None
    unless `reduction` counts them)."""
    reduction = reduction or LossReduction()
    depths = 0 if forward_only else max(_mtp_depths(c) for c in chunks)
    if depths:  # (before context parallelism cuts the samples)
        batches = [multi_token_targets(b, depths) if "labels" in b else b for b in batches]
    cp_group = None
    if state is not None:
        batches, cp_group = context_parallel_batches(batches, state), state.cp_group
    count = None
    if reduction.counts_tokens:
        count = per_token_count(batches, len(batches), state)
    # the MoE and MTP losses are differentiated as the main loss is (aux_loss.py; per token:
    # as megatron-core, summed over the global batch and divided by its token count)
    step_factor = loss_scale * group_size(cp_group) / len(batches)
    token_count = count.item() if reduction.per_token else None
    for chunk in chunks:
        scale = _module(chunk).ctx.moe_loss_scale
        scale.step_factor, scale.token_count = step_factor, token_count
    loss_func = make_loss_func(
        len(batches), loss_scale, cp_group, num_domains, count, reduction.per_token, only_domain
    )
    schedule = schedule or forward_backward_no_pipelining
    losses = schedule(chunks, batches, forward_step, loss_func, forward_only=forward_only)
    dp_size = state.dp_size if state is not None else 1
    return losses, None if count is None else count * (len(batches) * dp_size)


def shared_loss_tensor(
    losses: list[torch.Tensor], state, num_domains: int = 0, mtp_depths: int = 0
) -> torch.Tensor:
    """Mean of the last stage's micro-batch losses over the DP ranks (the sum of the CP
    ranks' shares), made known to every rank (the other pipeline stages contribute nothing
    to the sum): [loss], or with `num_domains` [loss, s_0 .., w_0 ..] (loss.py), then the
    `mtp_depths` multi-token-prediction losses, on the rank's device and not yet read
    (reading it waits for the device). Collective on all ranks."""
    size = 1 + 2 * num_domains + mtp_depths
    value = torch.zeros(size, dtype=torch.float64, device=state.device)
    if losses:
        value += torch.stack([x.reshape(-1) for x in losses]).double().mean(dim=0)
    if state.dp_cp_group is not None:
        dist.all_reduce(value, group=state.dp_cp_group)
        value /= state.dp_size
    if state.pp_group is not None:
        dist.all_reduce(value, group=state.pp_group)
    return value


def shared_loss(losses: list[torch.Tensor], state, num_domains: int = 0) -> list[float]:
    """shared_loss_tensor, read."""
    return shared_loss_tensor(losses, state, num_domains).tolist()


def eval_step(
    chunks,
    batches,
    state,
    schedule=None,
    num_domains: int = 0,
    reduction: LossReduction | None = None,
) -> tuple[list[float], float | None]:
    """Mean loss of the batches, without gradients, on every rank: ([loss] or, with
    `num_domains`, [loss, s_0 .., w_0 ..] (loss.py), and the count of tokens it is the mean
    over where `reduction` counts them, else None)."""
    for chunk in chunks:
        chunk.eval()
    try:
        losses, tokens = _counted_schedule(
            chunks, batches, schedule, True, 1.0, state, num_domains, reduction
        )
    finally:
        for chunk in chunks:
            chunk.train()
    return shared_loss(losses, state, num_domains), None if tokens is None else float(tokens)


def train_step(
    chunks,
    optimizer,
    scheduler,
    batches,
    state,
    schedule=None,
    *,
    features: StepFeatures | None = None,
    hooks: StepHooks | None = None,
    samples: int | None = None,
    reduction: LossReduction | None = None,
) -> StepResult:
    """Zero grads, forward/backward every micro-batch, reduce, set the learning rate, step.
    A non-finite gradient norm skips the update inside the optimizer, and `hooks` may decline
    it. The scheduler advances only when the update is applied, by `samples` (the global
    batch; default the scheduler's). Collective on all ranks."""
    features, hooks = features or StepFeatures(), hooks or StepHooks()
    times, local_squares = features.times, features.local_squares
    with measure(times, "optimizer"):
        optimizer.zero_grad()
    scale = optimizer.grad_scaler.scale if optimizer.grad_scaler is not None else 1.0
    if local_squares is not None:
        local_squares.attach(state.device)
    domains = features.num_domains
    if features.activation_stats is not None:
        features.activation_stats.arm()
    losses = run_schedule(
        chunks,
        batches,
        schedule,
        loss_scale=scale,
        state=state,
        num_domains=domains,
        reduction=reduction,
    )
    activations = None
    if features.activation_stats is not None:
        activations = features.activation_stats.collect(state.world_group)
    if hooks.after_backward is not None:
        hooks.after_backward()
    shared = [w for c in chunks if (w := c.module.shared_embedding_weight()) is not None]
    with measure(times, "grads-sync"):
        finalize_model_grads(chunks, state.tp_group, state.embedding_group, shared)
        moe = features.moe_metrics(chunks) if features.moe_metrics is not None else None
        for router in routers_of(chunks):  # the expert bias moves (megatron-core: here too)
            router.end_step(state.tp_group, state.dp_cp_group)
        # FP8 delayed scaling: the step's amaxes over the ranks holding each weight (TP x DP x
        # CP; the routed experts': expert TP x expert DP), the next step's scales
        update_delayed_scales(delayed_states(chunks, False), (state.tp_group, state.dp_cp_group))
        expert_groups = (state.expert_tp_group, state.expert_dp_group)
        update_delayed_scales(delayed_states(chunks, True), expert_groups)
    with measure(times, "grads-sync"):  # (the noise scale's reductions of the local norms)
        own = local_squares.detach(state, scale) if local_squares is not None else None
    with measure(times, "loss-sync"):
        # read after the update (the norm's read waits for the device anyway), unless a hook
        # must see the loss first: one host synchronisation per step, not two
        depths = max(_mtp_depths(c) for c in chunks)
        loss_tensor = shared_loss_tensor(losses, state, domains, depths)
        early = loss_tensor.tolist() if hooks.should_step is not None else None
    with measure(times, "optimizer"):
        lr = scheduler.apply(optimizer)
    loss_scale = optimizer.grad_scaler.scale if optimizer.grad_scaler is not None else None
    if early is not None and not hooks.should_step(early[0]):
        parts, mtp = _split_reported(early, domains)
        return StepResult(
            early[0], None, lr, False, loss_scale, None, own, parts, moe=moe, mtp_losses=mtp,
            activations=activations,
        )  # fmt: skip
    if hooks.before_update is not None:
        with measure(times, "save-checkpoint"):  # an asynchronous save's copy still running
            hooks.before_update()
    if hooks.gradient is not None:
        optimizer.set_gradient(hooks.gradient())
    with measure(times, "optimizer"):
        result = optimizer.step(
            features.norm_parts, count_zeros=features.num_zeros, update_parts=features.update_parts
        )
        params_norm = optimizer.params_norm() if features.params_norm else None
    if result.updated:
        # As Megatron-LM: the schedule moves on only after an update is applied, so a skipped
        # one (non-finite gradient, fp16 overflow, declined above) is retried at the same LR.
        scheduler.advance(samples)
    norm = result.grad_norm if math.isfinite(result.grad_norm) else None
    reported = early if early is not None else loss_tensor.tolist()
    parts, mtp = _split_reported(reported, domains)
    return StepResult(
        reported[0],
        norm,
        lr,
        result.updated,
        result.loss_scale,
        result.part_norms,
        own,
        parts,
        result.num_zeros,
        params_norm,
        moe,
        mtp,
        result.update_ratios,
        activations,
    )


def _split_reported(values: list[float], domains: int) -> tuple:
    """(a blend's [s_0 .., w_0 ..] or None, the MTP depths' losses or None) of a step's
    reported values [loss, s_0 .., w_0 .., mtp_1 ..] (shared_loss_tensor)."""
    parts, mtp = values[1 : 1 + 2 * domains], values[1 + 2 * domains :]
    return parts or None, mtp or None
