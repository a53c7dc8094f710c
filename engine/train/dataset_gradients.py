"""The gradient of each dataset of a blend, for gradient interference and surgery:
--log-gradient-cosine-interval (the cosine similarity of every pair of datasets' gradients,
whole and per layer group) and --pcgrad (Yu et al. 2020: each dataset's gradient projected off
the others' where they conflict, and the projected gradients summed into the step's).

Each dataset present in the step's global batch gets one more forward and backward pass over
the step's own micro-batches, in which only its tokens carry loss (over the same token counts
as the whole loss, so the datasets' gradients add up to the step's), then the usual reductions
(data-parallel, tensor-parallel, tied embeddings). The random states are put back before each
pass and after the last, so the passes see the step's own dropout and leave the run as it was.
Cost: one forward and backward per dataset present, and a copy of the gradient per dataset.

Dot products count every element once under any layout (parallel/data_parallel/optimizer.py's
`gram` and `dot`, summed over the same group as the gradient norm), so the cosines and the
surgery are the same numbers under any TP/SP/CP/PP/DP and sharding layout as on one process.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.train.rerun import StepSnapshot
from engine.train.step import run_schedule
from parallel.grads import finalize_model_grads
from parallel.timing import measure


@dataclass(frozen=True)
class DatasetGradients:
    names: tuple[str, ...]  # the datasets present in the step, in the blend's order
    gradients: list[list[torch.Tensor]]  # each one's gradient as the optimizer's pieces


def present(batches: list[dict], num_domains: int, state) -> list[int]:
    """The blend's datasets with a sample in the global batch (the same list on every rank:
    the ranks that read labels count, the counts are summed over every rank)."""
    counts = torch.zeros(num_domains, dtype=torch.float64, device=state.device)
    for batch in batches:
        if "labels" in batch and "domain" in batch:
            counts += torch.bincount(batch["domain"].reshape(-1), minlength=num_domains).double()
    if state.world_group is not None:
        dist.all_reduce(counts, group=state.world_group)
    return [d for d, count in enumerate(counts.tolist()) if count > 0]


def dataset_gradients(run, batches: list[dict]) -> DatasetGradients:
    """One pass per dataset present (module docstring). Collective on every rank."""
    state, optimizer, features = run.state, run.optimizer, run.features
    names = features.domain_names
    snapshot = StepSnapshot(run)
    scale = optimizer.grad_scaler.scale if optimizer.grad_scaler is not None else 1.0
    shared = [w for c in run.chunks if (w := c.module.shared_embedding_weight()) is not None]
    found, gradients = [], []
    times = features.times
    paused = times.paused() if times is not None else contextlib.nullcontext()
    with measure(times, "dataset-gradients"), paused:  # the passes' compute counted here
        for domain in present(batches, len(names), state):
            snapshot.restore(run)
            optimizer.zero_grad()
            run_schedule(
                run.chunks, batches, run.schedule, loss_scale=scale, state=state,
                num_domains=len(names), reduction=run.loss_reduction, only_domain=domain,
            )  # fmt: skip
            finalize_model_grads(run.chunks, state.tp_group, state.embedding_group, shared)
            found.append(names[domain])
            gradients.append(optimizer.gradient_copy())
        snapshot.restore(run)
    return DatasetGradients(tuple(found), gradients)


def cosines(run, found: DatasetGradients) -> dict[str, float]:
    """`grad_cosine/<a>|<b>` (whole model) and `grad_cosine/<a>|<b>/<part>` (each layer group
    of --log-grad-norms-interval's breakdown) for every pair of datasets present (a part where
    either gradient is zero has no entry), and each dataset's gradient norm
    (`grad_norm_dataset/<name>`)."""
    parts = run.features.cosine_parts
    products = run.optimizer.gram(found.gradients, parts).tolist()
    labels = ("",) + tuple(f"/{label}" for label in (parts.labels if parts else ()))
    scaler = run.optimizer.grad_scaler  # fp16: the copies are of the scaled gradients
    scale = scaler.scale if scaler is not None else 1.0
    out = {f"grad_norm_dataset/{name}": math.sqrt(products[0][i][i]) / scale
           for i, name in enumerate(found.names)}  # fmt: skip
    for index, suffix in enumerate(labels):
        gram = products[index]
        for i, a in enumerate(found.names):
            for j in range(i + 1, len(found.names)):
                norms = gram[i][i] * gram[j][j]
                if norms > 0:
                    out[f"grad_cosine/{a}|{found.names[j]}{suffix}"] = gram[i][j] / math.sqrt(norms)
    return out


def pcgrad(run, found: DatasetGradients, iteration: int) -> tuple[list[torch.Tensor], int]:
    """--pcgrad's gradient for the step (surgery, with the step's order) and its projection
    count."""
    generator = torch.Generator().manual_seed(run.cfg.training.seed * 1_000_003 + iteration)
    return surgery(found.gradients, run.optimizer.dot, generator)


def surgery(grads: list[list[torch.Tensor]], dot, generator: torch.Generator):
    """Gradient surgery (Yu et al. 2020): each gradient i (a list of tensors) is projected onto
    the normal plane of each other (original) gradient j it conflicts with (a negative dot
    product), j in a random order drawn from `generator` for each i; the projected gradients
    are summed. `dot(a, b)`: the dot product of two gradients. Returns (the sum, the number
    of projections made)."""
    count = len(grads)
    squares = [dot(g, g) for g in grads]
    combined = [torch.zeros_like(t) for t in grads[0]]
    projections = 0
    for i in range(count):
        own = [t.clone() for t in grads[i]]
        for j in torch.randperm(count, generator=generator).tolist():
            if j == i or squares[j] == 0:
                continue
            product = dot(own, grads[j])
            if product < 0:
                torch._foreach_add_(own, grads[j], alpha=-product / squares[j])
                projections += 1
        torch._foreach_add_(combined, own)
    return combined, projections
