"""The tests' way to run parallel code for real: `run_ranks` forks N gloo ranks (see
parallel/local_ranks.py: free port, one thread per rank, timeout, the failing rank's traceback).

Forking costs milliseconds per rank (spawning costs seconds), so group many checks into one
`run_ranks` call and return plain data (numbers, lists, CPU tensors) for the test to assert on.
"""

from __future__ import annotations

import torch

from parallel.local_ranks import run_local, start_forkserver

__all__ = ["run_ranks", "rel_err", "start_rank_server"]

# megatron-core's modules that the reference ranks import (about 2.4 s of a core per rank when
# each imports them itself): imported once, in the forkserver every rank is forked from. A
# machine without megatron-core skips them.
MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.multi_latent_attention",
)


def start_rank_server() -> None:
    """The forkserver every rank (and every preprocessing worker) of this process is forked
    from, started with the ranks' preload before anything else can start it without."""
    start_forkserver(MEGATRON_MODULES)


def run_ranks(fn, world_size: int, *args, **kwargs):
    """parallel.local_ranks.run_local, with megatron-core's modules preloaded."""
    return run_local(fn, world_size, *args, also_preload=MEGATRON_MODULES, **kwargs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the absolute difference when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    denominator = b.norm().item()
    return (a - b).norm().item() / denominator if denominator else (a - b).norm().item()
