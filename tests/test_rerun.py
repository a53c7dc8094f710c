"""--rerun-on-nan on two data-parallel gloo ranks: a NaN injected into one rank's gradient is
gone when the step is computed again (a transient fault: the rank is named and the run equals
one without the fault), a poisoned batch is NaN again (its samples are named and the step is
skipped)."""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed import run_ranks
from tests.test_restarts import SMALL_RUN

MOCK = [*SMALL_RUN, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _train(rank, world, argv, env):
    os.environ.update(env or {})  # the ranks' own environment (the faults read it)
    from engine.pretrain import main

    return main(argv)


def _losses(path) -> list[tuple[int, float, int]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["iteration"], r["lm_loss"], r["skipped_iters"]) for r in records if "split" not in r]


def _run(tmp_path, name: str, *flags: str, env=None) -> list[tuple[int, float, int]]:
    log = tmp_path / f"{name}.jsonl"
    run_ranks(_train, 2, [*MOCK, "--train-iters", "5", "--log-jsonl", str(log), *flags], env)
    return _losses(log)


# FP8 delayed scaling's amax history, updated at the end of every step, is put back too: a
# history of 3 with "max" keeps the first attempt's amaxes in sight of the next steps' scales
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "3", "--fp8-amax-compute-algo", "max"]


@pytest.mark.parametrize("extra", [[], FP8], ids=["plain", "fp8-delayed"])
def test_a_transient_nan_is_recomputed_and_the_run_goes_on(extra, tmp_path, capfd):
    reference = _run(tmp_path, "reference", *extra)
    fault = {"TRIPOD_FAULT_NAN_GRAD_AT": "3"}  # rank 0, before the DP reduction
    rerun = _run(tmp_path, "rerun", "--rerun-on-nan", *extra, env=fault)
    out = capfd.readouterr().out
    assert (
        "iteration 3: NaN/Inf loss or gradient (non-finite local gradient on rank(s) 0); "
        "recomputed from the same state and data: finite (lm loss"
    ) in out
    assert "a transient fault; the step goes on with the recomputed result" in out
    assert rerun == reference  # every loss equal, nothing skipped
    assert all(skipped == 0 for _, _, skipped in rerun)
    if extra:
        return
    skipped = _run(tmp_path, "without", env=fault)  # the fault without the flag
    assert skipped[2][2] == 1 and skipped != reference


@pytest.mark.parametrize("flag", [["--rerun-on-nan"], ["--rerun-mode", "validate_results"]])
def test_a_poisoned_batch_is_nan_again_and_skipped(flag, tmp_path, capfd):
    losses = _run(tmp_path, "poisoned", *flag, env={"TRIPOD_FAULT_NAN_BATCH_AT": "3"})
    out = capfd.readouterr().out
    assert (
        "iteration 3: NaN/Inf loss or gradient (non-finite local gradient on rank(s) 0, 1); "
        "recomputed from the same state and data: NaN/Inf again, so the data or the model: "
        "the global batch of training samples 8 to 11 (in the order the run reads them); the "
        "step is skipped (--rerun-on-nan)"
    ) in out
    assert [skipped for _, _, skipped in losses] == [0, 0, 1, 1, 1]
