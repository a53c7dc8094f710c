"""The tests' way to run parallel code for real: `run_ranks` forks N gloo ranks (see
parallel/local_ranks.py: free port, one thread per rank, timeout, the failing rank's traceback).

Forking costs milliseconds per rank (spawning costs seconds), so group many checks into one
`run_ranks` call and return plain data (numbers, lists, CPU tensors) for the test to assert on.
"""

from __future__ import annotations

import torch

from parallel.local_ranks import run_local as run_ranks

__all__ = ["run_ranks", "rel_err"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the absolute difference when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    denominator = b.norm().item()
    return (a - b).norm().item() / denominator if denominator else (a - b).norm().item()
