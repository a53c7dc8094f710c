"""fp16's dynamic loss scale (parallel/data_parallel/grad_scaler.py) against megatron-core
0.16.1's DynamicGradScaler on the same overflow patterns: growth after --loss-scale-window
clean steps, back-off after --hysteresis overflows in a row (and not below --min-loss-scale),
the hysteresis restored only by a growth, step by step. megatron-core keeps its scale in CUDA
tensors: on the CPU its `device="cuda"` tensors are made on the CPU
(tests/test_megatron_optimizer.py's stand-in), nothing else of it is changed."""

from __future__ import annotations

import random

import pytest

from parallel.data_parallel.grad_scaler import DynamicGradScaler
from tests.distributed import run_ranks
from tests.requirements import require
from tools.megatron_cpu import cuda_tensors_on_cpu

SETTINGS = [
    dict(initial_scale=2.0**16, min_scale=1.0, growth_interval=4, hysteresis=2),
    dict(initial_scale=2.0**8, min_scale=2.0**5, growth_interval=3, hysteresis=1),
    dict(initial_scale=2.0**20, min_scale=1.0, growth_interval=1, hysteresis=3),
]


def _patterns() -> list[list[bool]]:
    """Overflow (True) patterns: runs of overflows longer than any hysteresis, clean runs longer
    than any window, alternations, and random ones."""
    rng = random.Random(0)
    fixed = [
        [True] * 12 + [False] * 10,
        [False] * 9 + [True, False, True, True, False, True, True, True],
        [True, False] * 10,
    ]
    return fixed + [[rng.random() < p for _ in range(60)] for p in (0.2, 0.5, 0.8)]


def _compare(rank, world, settings) -> list[tuple]:
    """(ours, megatron-core's) scale and trackers after every step of every pattern; in a
    process of its own, as the CPU stand-in patches torch."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler as Theirs

    cuda_tensors_on_cpu()
    factors = dict(growth_factor=2.0, backoff_factor=0.5)
    out = []
    for pattern in _patterns():
        ours = DynamicGradScaler(**settings, **factors)
        theirs = Theirs(**settings, **factors)
        for found_inf in pattern:
            ours.update(found_inf)
            theirs.update(found_inf)
            state, mine = theirs.state_dict(), ours.state_dict()
            trackers = ("growth_tracker", "hysteresis_tracker")
            out.append(
                (
                    (ours.scale, *(mine[k] for k in trackers)),
                    (float(theirs.scale.item()), *(state[k] for k in trackers)),
                )
            )
    return out


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: str(s["hysteresis"]))
def test_the_loss_scale_follows_megatron_cores(settings):
    require("megatron.core")
    (steps,) = run_ranks(_compare, 1, settings)
    assert len(steps) > 100
    for step, (ours, theirs) in enumerate(steps):
        assert ours == theirs, (settings, step)
    assert len({ours[0] for ours, _ in steps}) > 3  # the patterns moved the scale
