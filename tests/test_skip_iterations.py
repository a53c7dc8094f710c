"""--iterations-to-skip (Megatron-LM's meaning: N skips the step after N completed ones): the
skipped steps' batches are read and dropped, nothing is trained, and the steps after train on
the same data they would have. With a learning rate of 0 the weights never move, so each
step's loss (without dropout) is a function of its batch alone: the run that skips equals the
run that does not at every step it trains."""

from __future__ import annotations

import json

from tests.distributed import run_ranks
from tests.test_rerun import MOCK, _train


def _losses(path) -> dict[int, tuple[float, int]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        r["iteration"]: (r["lm_loss"], r["consumed_samples"]) for r in records if "split" not in r
    }


def test_skipped_steps_drop_their_batches(tmp_path, capfd):
    frozen = [*MOCK, "--train-iters", "6", "--lr", "0", "--lr-warmup-iters", "0"]
    frozen += ["--hidden-dropout", "0", "--attention-dropout", "0"]  # (no random state used)
    whole, skipping = tmp_path / "whole.jsonl", tmp_path / "skipping.jsonl"
    run_ranks(_train, 2, [*frozen, "--log-jsonl", str(whole)], {})
    run_ranks(
        _train, 2, [*frozen, "--log-jsonl", str(skipping), "--iterations-to-skip", "2", "3"], {}
    )
    out = capfd.readouterr().out
    assert "iteration 3: skipped with its 4 samples (--iterations-to-skip 2)" in out
    assert "iteration 4: skipped with its 4 samples (--iterations-to-skip 3)" in out
    every, some = _losses(whole), _losses(skipping)
    assert sorted(some) == [1, 2, 5, 6]
    assert {k: some[k] for k in some} == {k: every[k] for k in some}  # same batch and count
