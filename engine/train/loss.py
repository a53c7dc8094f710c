"""The loss of a micro-batch on the last pipeline stage: per-token losses into the scalar to
differentiate and the values to report (the mean; with a blend, each dataset's part), under
context parallelism each rank's share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import group_size


@dataclass(frozen=True)
class LossReduction:
    """How token losses become the step's loss, as Megatron-LM reduces them.

    `per_token` (--calculate-per-token-loss): what is differentiated is the global batch's
    summed token losses over its count of tokens that carry loss; otherwise each
    micro-batch's mean, averaged over micro-batches and DP. `masked` (--eod-mask-loss): the
    micro-batches' counts differ, so the reported loss (Megatron-LM's, in either case the
    global batch's sum over its count) needs the global count too."""

    per_token: bool = False
    masked: bool = False

    @property
    def counts_tokens(self) -> bool:
        return self.per_token or self.masked


def make_loss_func(
    num_microbatches: int,
    loss_scale: float = 1.0,
    cp_group=None,
    num_domains: int = 0,
    token_count: torch.Tensor | None = None,
    per_token: bool = False,
    only_domain: int | None = None,
):
    """Per-token losses [b, s] -> (mean / num_microbatches * loss_scale, detached mean).
    A (loss, z-loss) pair from the model adds the z-loss to what is differentiated only; a
    triple's third part, multi-token prediction's losses [D] (already in the gradient through
    the token losses), is appended to the detached values.

    With `num_domains` (a blend whose batches say each sample's dataset, `domain`), the
    detached value is [mean, s_0 .. s_{D-1}, w_0 .. w_{D-1}]: w_d is the share of the mean's
    token weight that dataset d's tokens carry and s_d their weighted loss, so s_d / w_d is
    dataset d's loss and the s_d add up to the mean (see `domain_losses`).

    Under context parallelism (cp_group) each rank holds part of every sequence: its "mean"
    is its share of the micro-batch's mean (its tokens' sum over the whole micro-batch's token
    count), so the shares of a CP group add up to the mean. What is differentiated is scaled
    by the CP size, because gradients are averaged over DP x CP while the CP ranks' parts
    must add up.

    With `token_count` (`per_token_count`: the global batch's tokens that carry loss over
    micro-batches x DP) the reported values divide every micro-batch's summed token losses by
    that one count instead of its own: their mean over micro-batches and DP ranks is then the
    global batch's summed loss over its token count, what Megatron-LM reports. With
    `per_token` (--calculate-per-token-loss) that is also what is differentiated.

    With `only_domain` (a blend's dataset d) what is differentiated counts dataset d's tokens
    alone, over the same token counts as the whole loss: the datasets' gradients add up to
    the step's (engine/train/dataset_gradients.py)."""
    cp_size = group_size(cp_group)

    def loss_func(output, batch: dict):
        token_losses, z_term, side = output_parts(output)
        mask = batch.get("loss_mask")
        weights = None if mask is None else mask.to(token_losses.dtype)
        if only_domain is not None:  # the other datasets' tokens carry no loss, counts kept
            selected = (batch["domain"] == only_domain).to(token_losses.dtype)[:, None]
            token_losses = token_losses * selected
            z_term = None if z_term is None else z_term * selected
        if per_token:
            count = token_count.to(token_losses.dtype)
            summed = token_losses if weights is None else token_losses * weights
            share = summed.sum() / count
            total = share
            if z_term is not None:
                total = total + (z_term if weights is None else z_term * weights).sum() / count
            loss, reported = total * (cp_size * loss_scale / num_microbatches), share.detach()
        elif cp_size == 1:
            count = token_losses.numel() if weights is None else weights.sum().clamp(min=1.0)
            loss, reported = _mean_loss(token_losses, z_term, mask, num_microbatches, loss_scale)
        else:
            if weights is None:
                count = float(token_losses.numel() * cp_size)
            else:
                total_count = weights.sum().detach().clone()
                dist.all_reduce(total_count, group=cp_group)
                count = total_count.clamp(min=1.0)

            def share_of(values):
                return (values if weights is None else values * weights).sum() / count

            share = share_of(token_losses)
            total = share if z_term is None else share + share_of(z_term)
            loss, reported = total * (cp_size * loss_scale / num_microbatches), share.detach()
        if token_count is not None and not per_token:  # reported over the global count
            count = token_count.to(token_losses.dtype)
            summed = token_losses if weights is None else token_losses * weights
            reported = (summed.sum() / count).detach()
        if num_domains and "domain" not in batch:
            raise ValueError("per-dataset losses asked for, but the batch says no sample's dataset")
        if num_domains:
            parts = _domain_parts(
                token_losses.detach(), weights, count, batch["domain"], num_domains
            )
            reported = torch.cat([reported.reshape(1), parts])
        if side is not None:  # multi-token prediction's depths, reported after the rest
            reported = torch.cat([reported.reshape(-1), side.to(reported.dtype)])
        return loss, reported

    return loss_func


def output_parts(output) -> tuple:
    """(token losses [b, s], z-loss term or None, the multi-token-prediction depths' losses
    as reported or None) of what the last stage returns: the token losses alone, or a pair
    with the z-loss term, or a triple (engine/model/gpt.py)."""
    if not isinstance(output, tuple):
        return output, None, None
    return (*output, None)[:3]


def per_token_count(batches: list[dict], num_microbatches: int, state) -> torch.Tensor:
    """--calculate-per-token-loss's count (make_loss_func's `token_count`): the tokens of
    the global batch that carry loss (the last pipeline stage's micro-batches `batches`, cut
    for context parallelism, summed over its DP x CP group, then made known to every stage)
    over (micro-batches x DP). Collective on every rank."""
    device = state.device if state is not None else None
    count = torch.zeros((), dtype=torch.float64, device=device)
    if state is None or state.is_last_stage:
        for batch in batches:
            mask = batch.get("loss_mask")
            count += mask.sum() if mask is not None else batch["labels"].numel()
    dp_size = 1
    if state is not None and state.dp_cp_group is not None:
        dist.all_reduce(count, group=state.dp_cp_group)
        dp_size = state.dp_size
    if state is not None and state.pp_group is not None:  # the other stages add nothing
        dist.all_reduce(count, group=state.pp_group)
    return (count / (num_microbatches * dp_size)).clamp(min=1e-30).float()


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
