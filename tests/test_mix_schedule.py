"""--data-mix-schedule: blend weights that change at exact iterations, resumed exactly, with
each dataset's tokens logged; bad schedules refused in one line (exit code 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config.batch_schedule import BatchSchedule
from engine.data.builder import build_gpt_datasets
from engine.data.indexed.dataset import IndexedDataset
from engine.data.indexed.helpers import build_blending_indices
from engine.data.mix.schedule import check_resumed_schedule, read_mix_schedule
from engine.data.sources import data_sources
from engine.errors import ConfigError
from tests.cli import one_line_error, run_python
from tests.test_training import base_args, latest, losses, pretrain, records

NAMES = ("web", "code", "books")


def _schedule(tmp_path, phases, name="mix.json", train_iters=10, batches=None):
    path, batches = tmp_path / name, batches or BatchSchedule(8)
    text = json.dumps({"phases": phases}) if name.endswith(".json") else phases
    path.write_text(text)
    return read_mix_schedule(str(path), NAMES, [6, 3, 1], train_iters, batches)


def test_phases_switch_at_exact_iterations_and_never_repeat_a_sample(tmp_path):
    yaml = "phases:\n  - at: 0.8\n    weights: {books: 3, web: 1}\n"
    mix = _schedule(tmp_path, yaml, "anneal.yaml")
    # before the phase, --data-path's weights; 0.8 of 80 samples is iteration 8 at batch 8
    assert [(p.iteration, p.first_sample) for p in mix.phases] == [(0, 0), (8, 64)]
    assert mix.phases[0].weights == pytest.approx((0.6, 0.3, 0.1))
    assert mix.phases[1].weights == pytest.approx((0.25, 0.0, 0.75))
    which, nth = mix.blending_indices(80)
    # the first 64 samples are the plain blend's order, sample for sample
    plain_which, plain_nth = build_blending_indices([0.6, 0.3, 0.1], 64)
    assert np.array_equal(which[:64], plain_which) and np.array_equal(nth[:64], plain_nth)
    # then only web and books, 1:3, every greedy prefix within one sample of its share
    tail = which[64:]
    assert 1 not in tail
    for i in range(1, len(tail) + 1):
        assert abs(np.sum(tail[:i] == 2) - 0.75 * i) <= 1
    # each dataset's samples are taken in order across phases: none twice, none skipped
    for d in range(3):
        assert nth[which == d].tolist() == list(range(int(np.sum(which == d))))
    assert mix.phase_at(7).iteration == 0 and mix.phase_at(8).iteration == 8


def test_fractions_fall_on_step_boundaries_under_a_batch_ramp(tmp_path):
    # ramp 4 -> 8 over the first 24 samples: steps of 4, 4, 4, 4, 4, 4, 8 ... (batch_schedule)
    batches = BatchSchedule(8, rampup=(4, 4, 24))
    _, total = batches.sizes(10)
    mix = _schedule(tmp_path, [{"at": 0.5, "weights": {"web": 1}}], train_iters=10, batches=batches)
    phase = mix.phases[1]
    assert phase.first_sample == batches.sizes(phase.iteration)[1] >= 0.5 * total
    assert batches.sizes(phase.iteration - 1)[1] < 0.5 * total


@pytest.mark.parametrize(
    "phases, expected",
    [
        ([{"at": 0.5, "weights": {"news": 1}}], "'news' is not a dataset of --data-path"),
        ([{"at": 0.5, "weights": {"web": 0}}], "the weights are all zero"),
        ([{"at": 0.5, "weights": {"web": -1}}], "is not a number >= 0"),
        ([{"at": 1.0, "weights": {"web": 1}}], "is not a fraction of training in [0, 1)"),
        ([{"at": 0.5, "iteration": 3, "weights": {"web": 1}}], "give one of `at`"),
        ([{"iteration": 12, "weights": {"web": 1}}], "not a whole number in [0, 10)"),
        (
            [{"at": 0.6, "weights": {"web": 1}}, {"at": 0.5, "weights": {"code": 1}}],
            "phase 2 starts at iteration 5, not after phase 1",
        ),
        ([{"at": 0.99, "weights": {"web": 1}}], "when training (10 iterations) is over"),
        ({}, "no `phases` list"),
    ],
)
def test_bad_schedules_are_refused_naming_the_file(tmp_path, phases, expected):
    with pytest.raises(ConfigError) as err:
        if isinstance(phases, dict):
            (tmp_path / "mix.json").write_text(json.dumps(phases))
            read_mix_schedule(str(tmp_path / "mix.json"), NAMES, [1, 1, 1], 10, BatchSchedule(8))
        else:
            _schedule(tmp_path, phases)
    message = str(err.value)
    assert message.startswith("--data-mix-schedule ") and expected in message, message
    assert "\n" not in message


def test_a_resume_keeps_the_phases_already_begun():
    before = [{"iteration": 0, "weights": {"web": 0.5, "code": 0.5}}]

    def mix(*phases, scheduled=True, samples=80):
        return {"phases": before + list(phases), "scheduled": scheduled, "run_samples": samples}

    saved = mix({"iteration": 6, "weights": {"web": 1.0, "code": 0.0}})
    later = mix({"iteration": 8, "weights": {"web": 0.0, "code": 1.0}})
    check_resumed_schedule(saved, later, 4)  # the second phase had not begun: may change
    with pytest.raises(ConfigError, match="differ from those the checkpoint trained with"):
        check_resumed_schedule(saved, later, 7)
    with pytest.raises(ConfigError, match="changes each dataset's order"):
        check_resumed_schedule(saved, mix(samples=96), 4)
    check_resumed_schedule(None, later, 7)  # a checkpoint from before mixes were recorded
    # blends of fixed weights resume as Megatron-LM's do, whatever the weights
    plain = {"phases": [{"iteration": 0, "weights": {"web": 0.2, "code": 0.8}}],
             "scheduled": False, "run_samples": 0}  # fmt: skip
    check_resumed_schedule(mix(scheduled=False), plain, 7)
    with pytest.raises(ConfigError, match="trained without a mix schedule"):
        check_resumed_schedule(plain, saved, 7)  # a schedule added to a fixed blend


def test_a_later_phase_changed_leaves_the_samples_already_read(dataset_prefix, tmp_path):
    blend = ["0.5", f"web:{dataset_prefix}", "0.5", f"code:{dataset_prefix}"]
    names, batches = ("web", "code"), BatchSchedule(8)
    built = []
    for at in (0.5, 0.75):
        path = tmp_path / f"mix{at}.json"
        path.write_text(json.dumps({"phases": [{"at": at, "weights": {"code": 1}}]}))
        mix = read_mix_schedule(str(path), names, [0.5, 0.5], 10, batches)
        sources = data_sources(blend, "100,0,0")
        train = build_gpt_datasets(sources, 32, 1234, (80, 0, 0), None, mix=mix)[0]
        built.append(train)
    first, second = built
    for i in range(40):  # the first 5 iterations: before either switch
        assert np.array_equal(first[i], second[i]), i
    assert any(not np.array_equal(first[i], second[i]) for i in range(40, 80))


def _args(dataset_prefix, tokenizer_model, tmp_path, log, schedule, **extra):
    return base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--data-path": ["0.5", f"web:{dataset_prefix}", "0.5", f"code:{dataset_prefix}"],
            "--data-mix-schedule": str(schedule),
            "--train-iters": "8",
            "--log-jsonl": str(tmp_path / log),
            **extra,
        },
    )


def test_training_switches_exactly_and_resumes_exactly(dataset_prefix, tokenizer_model, tmp_path):
    schedule = tmp_path / "anneal.yaml"
    schedule.write_text("phases:\n  - at: 0.5\n    weights: {code: 1}\n")

    def args(log, **extra):
        return _args(dataset_prefix, tokenizer_model, tmp_path, log, schedule, **extra)

    assert pretrain(2, args("straight.jsonl")) == [0, 0]
    train = [r for r in records(tmp_path / "straight.jsonl") if "split" not in r]
    seq, batch = 32, 8
    for r in train:
        it = r["iteration"]
        web_samples = 4 * min(it, 4)  # 4 of each batch of 8 until iteration 4, then none
        assert r["consumed_tokens/web"] == web_samples * seq, r
        assert r["consumed_tokens/code"] == (it * batch - web_samples) * seq, r
        # the step that made this record trained with the phase of its start
        assert r["mix_weight/web"] == (0.5 if it <= 4 else 0.0), r
        if it > 4:  # no web sample in the batch: no web loss at all
            assert r.get("lm_loss_share/web", 0.0) == 0.0 and r["lm_loss_share/code"] == 1.0
        else:
            assert r["lm_loss_share/web"] == pytest.approx(0.5, abs=0.1)

    ckpt = str(tmp_path / "ckpt")
    first = args("a.jsonl", **{"--save": ckpt, "--save-interval": "3", "--exit-interval": "3"})
    assert pretrain(2, first) == [0, 0]
    assert latest(ckpt) == "3"
    assert pretrain(2, args("b.jsonl", **{"--load": ckpt})) == [0, 0]
    resumed = losses(tmp_path / "a.jsonl") | losses(tmp_path / "b.jsonl")
    assert resumed == losses(tmp_path / "straight.jsonl")  # bit for bit, across the switch

    # a phase moved before the checkpoint's iteration: refused, the checkpoint kept
    schedule.write_text("phases:\n  - at: 0.25\n    weights: {code: 1}\n")
    line = one_line_error(
        run_python("-m", "engine.pretrain", *args("c.jsonl", **{"--load": ckpt, "--save": ckpt}))
    )
    assert "--data-mix-schedule: the blend weights before iteration 3 differ" in line, line
    assert latest(ckpt) == "3"


def test_mix_report_counts_tokens_and_epochs_per_dataset(dataset_prefix, tmp_path):
    schedule = tmp_path / "anneal.yaml"
    schedule.write_text("phases:\n  - at: 0.8\n    weights: {code: 1}\n")
    blend = ["0.7", f"web:{dataset_prefix}", "0.3", f"code:{dataset_prefix}"]
    common = ["--data-path", *blend, "--seq-length", "32", "--global-batch-size", "8",
              "--split", "100,0,0", "--data-mix-schedule", str(schedule)]  # fmt: skip
    out = tmp_path / "report.json"
    result = run_python("tools/mix_report.py", *common, "--train-iters", "200", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["phase_starts"] == [0, 160]  # 80% of 1,600 samples: iteration 160
    web, code = report["datasets"]
    # 160 iterations of 8 samples at 0.7 / 0.3, then 40 of code alone; 32 tokens a sample
    assert web["tokens_planned"] == round(1280 * 0.7) * 32
    assert code["tokens_planned"] == (round(1280 * 0.3) + 320) * 32
    tokens = int(IndexedDataset(dataset_prefix).sequence_lengths.sum())
    assert web["tokens_available"] == code["tokens_available"] == tokens
    assert web["epochs"] == pytest.approx(web["tokens_planned"] / tokens)
    assert "warning" not in result.stderr

    long = run_python("tools/mix_report.py", *common, "--train-iters", "10000")
    assert long.returncode == 0, long.stderr
    assert "warning: web" in long.stderr and "more than --max-epochs 4" in long.stderr
    bad = run_python("tools/mix_report.py", *common[:-1], str(tmp_path / "none.yaml"),
                     "--train-iters", "10")  # fmt: skip
    assert "cannot read it" in one_line_error(bad)
