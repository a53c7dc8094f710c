"""The training run end to end: exact resume, resharding, crash safety of checkpoints, NaN and
spike handling, failures on one rank, metrics, and the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from engine.errors import CheckpointError
from engine.monitor.metrics import SpikeDetector
from tests.cli import CPU_ONLY
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_args(dataset_prefix, tokenizer_model, **overrides) -> list[str]:
    args = {
        "--data-path": dataset_prefix,
        "--tokenizer-model": tokenizer_model,
        "--split": "90,10,0",
        "--num-layers": "4",
        "--hidden-size": "32",
        "--num-attention-heads": "4",
        "--seq-length": "32",
        "--micro-batch-size": "2",
        "--global-batch-size": "8",
        "--lr": "3e-3",
        "--min-lr": "3e-4",
        "--lr-warmup-iters": "2",
        "--train-iters": "20",
        "--log-interval": "1",
        "--eval-interval": "1000",
        "--eval-iters": "1",
        "--hidden-dropout": "0.1",
        "--attention-dropout": "0.1",
        "--make-vocab-size-divisible-by": "16",
        # Megatron-LM's default is 2 worker processes per rank; the tests that want them say so
        "--num-workers": "0",
    }
    args.update(overrides)
    args.setdefault("--max-position-embeddings", args["--seq-length"])
    out = []
    for key, value in args.items():
        if value is None:
            continue
        out.append(key)
        if value is not True:
            out.extend(value if isinstance(value, list) else [value])
    return out


def _pretrain(rank, world, argv, env=None):
    os.environ.update(env or {})
    from engine.pretrain import main

    return main(argv)


def pretrain(world, argv, env=None, timeout=300):
    return run_ranks(_pretrain, world, argv, env, timeout=timeout)


def read(path) -> str:
    with open(path) as f:
        return f.read()


def records(path) -> list[dict]:
    return [json.loads(line) for line in read(path).splitlines() if line.strip()]


def latest(ckpt) -> str:
    return read(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).strip()


def straight_and_resumed(args_of, tmp_path, stop_at: int):
    """(losses of a straight run, of one stopped at `stop_at` and resumed) on one process;
    `args_of(name, **flags)`: a run's arguments, logging to tmp_path/<name>.jsonl; the
    checkpoint goes to tmp_path/ckpt."""
    ckpt = str(tmp_path / "ckpt")
    pretrain(1, args_of("straight"))
    saving = {"--save": ckpt, "--save-interval": str(stop_at), "--exit-interval": str(stop_at)}
    pretrain(1, args_of("a", **saving))
    assert latest(ckpt) == str(stop_at)
    pretrain(1, args_of("b", **{"--load": ckpt}))
    resumed = losses(tmp_path / "a.jsonl") | losses(tmp_path / "b.jsonl")
    return losses(tmp_path / "straight.jsonl"), resumed


def losses(path) -> dict[int, float]:
    out = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "split" not in record:
                out[record["iteration"]] = record["lm_loss"]
    return out


@pytest.mark.parametrize(
    "world, layout",
    [
        (
            4,
            {
                "--tensor-model-parallel-size": "2",
                "--pipeline-model-parallel-size": "2",
                "--sequence-parallel": True,
            },
        ),
        (
            2,
            {
                "--use-distributed-optimizer": True,
                "--overlap-grad-reduce": True,
                "--async-save": True,
            },
        ),
        (2, {"--use-megatron-fsdp": True, "--overlap-grad-reduce": True}),
        (
            2,
            {
                "--context-parallel-size": "2",
                "--use-distributed-optimizer": True,
                "--attention-dropout": "0.0",
            },
        ),
    ],
    ids=["tp2-pp2", "dp2-zero-async", "dp2-fsdp-params", "cp2-zero"],
)
def test_resume_is_bit_exact(dataset_prefix, tokenizer_model, tmp_path, world, layout):
    def args(**extra):
        return base_args(
            dataset_prefix, tokenizer_model, **layout, **{"--train-iters": "8"}, **extra
        )

    pretrain(world, args(**{"--log-jsonl": str(tmp_path / "straight.jsonl")}))
    ckpt = str(tmp_path / "ckpt")
    pretrain(
        world,
        args(
            **{
                "--log-jsonl": str(tmp_path / "a.jsonl"),
                "--save": ckpt,
                "--save-interval": "2",
                "--exit-interval": "5",
            }
        ),
    )
    assert latest(ckpt) == "5"
    # Iteration 4's checkpoint was taken while training went on (with --async-save, copied in
    # the background during iteration 5): resuming from it must be exact too.
    at4 = tmp_path / "at4"
    shutil.copytree(os.path.join(ckpt, "iter_0000004"), at4 / "iter_0000004")
    (at4 / "latest_checkpointed_iteration.txt").write_text("4\n")
    pretrain(world, args(**{"--log-jsonl": str(tmp_path / "b.jsonl"), "--load": ckpt}))
    pretrain(world, args(**{"--log-jsonl": str(tmp_path / "c.jsonl"), "--load": str(at4)}))
    straight = losses(tmp_path / "straight.jsonl")
    first = losses(tmp_path / "a.jsonl")
    for resumed in (
        first | losses(tmp_path / "b.jsonl"),
        {k: v for k, v in first.items() if k <= 4} | losses(tmp_path / "c.jsonl"),
    ):
        assert sorted(straight) == list(range(1, 9)) == sorted(resumed)
        assert resumed == straight  # bit for bit: the floats are equal
    assert straight[8] < straight[1] - 0.15  # it learns (measured: 7.60 -> 7.33)


def test_checkpoint_reshards_to_other_layouts(dataset_prefix, tokenizer_model, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = {"--hidden-dropout": "0.0", "--attention-dropout": "0.0", "--train-iters": "5"}
    original = {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2"}
    pretrain(
        4,
        base_args(
            dataset_prefix,
            tokenizer_model,
            **common,
            **original,
            **{"--save": ckpt, "--exit-interval": "3"},
        ),
    )
    results = {}
    layouts = {
        "original": (4, original),
        "tp1-dp2-zero": (2, {"--use-distributed-optimizer": True}),
        "dp4-sharded-params": (4, {"--use-megatron-fsdp": True}),
        "tp2-dp2-sharded-grads": (
            4,
            {
                "--tensor-model-parallel-size": "2",
                "--use-megatron-fsdp": True,
                "--data-parallel-sharding-strategy": "optim_grads",
            },
        ),
        "tp4": (4, {"--tensor-model-parallel-size": "4"}),
        "cp2-dp2-zero-a2a": (
            4,
            {
                "--context-parallel-size": "2",
                "--cp-comm-type": "a2a",
                "--use-distributed-optimizer": True,
            },
        ),
        "tp2-sp-cp2": (
            4,
            {
                "--tensor-model-parallel-size": "2",
                "--sequence-parallel": True,
                "--context-parallel-size": "2",
            },
        ),
        "pp2-interleaved-overlap": (
            2,
            {
                "--pipeline-model-parallel-size": "2",
                "--num-layers-per-virtual-pipeline-stage": "1",
                "--overlap-p2p-communication": True,
            },
        ),
    }
    for name, (world, layout) in layouts.items():
        log = str(tmp_path / f"{name}.jsonl")
        pretrain(
            world,
            base_args(
                dataset_prefix,
                tokenizer_model,
                **common,
                **layout,
                **{"--load": ckpt, "--log-jsonl": log},
            ),
        )
        results[name] = losses(log)
    # the resumed run continues the uninterrupted one (a --load that were ignored would log
    # iterations 1 to 5 from fresh weights, and no resumed layout would match it)
    straight_log = str(tmp_path / "straight.jsonl")
    pretrain(
        4,
        base_args(
            dataset_prefix, tokenizer_model, **common, **original, **{"--log-jsonl": straight_log}
        ),
    )
    straight = losses(straight_log)
    reference = results.pop("original")
    assert sorted(reference) == [4, 5]
    assert reference == {i: straight[i] for i in (4, 5)}  # bit for bit: the same layout
    for name, values in results.items():
        assert sorted(values) == [4, 5], (name, values)  # resumed after iteration 3
        for iteration in (4, 5):  # 5 also depends on the resharded optimizer state
            assert abs(values[iteration] - reference[iteration]) / reference[iteration] < 1e-5, (
                name,
                iteration,
                values,
                reference,
            )


def test_checkpoint_saved_with_context_parallelism_loads_without(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Saved under CP4 (optimizer state sharded over the CP ranks), resumed under CP 4, CP 2
    with all-to-all attention, and one process: the same losses."""
    ckpt = str(tmp_path / "ckpt")
    common = {"--hidden-dropout": "0.0", "--attention-dropout": "0.0", "--train-iters": "5"}
    cp4 = {"--context-parallel-size": "4", "--use-distributed-optimizer": True}
    pretrain(
        4,
        base_args(dataset_prefix, tokenizer_model, **common, **cp4, **{"--save": ckpt,
                  "--exit-interval": "3"}),
    )  # fmt: skip
    layouts = {
        "cp4": (4, cp4),
        "cp2-a2a-dp2": (4, {"--context-parallel-size": "2", "--cp-comm-type": "a2a"}),
        "one": (1, {}),
    }
    results = {}
    for name, (world, layout) in layouts.items():
        log = str(tmp_path / f"{name}.jsonl")
        extra = {"--load": ckpt, "--log-jsonl": log}
        pretrain(world, base_args(dataset_prefix, tokenizer_model, **common, **layout, **extra))
        results[name] = losses(log)
    reference = results.pop("cp4")
    assert sorted(reference) == [4, 5]
    for name, values in results.items():
        for iteration in (4, 5):
            assert abs(values[iteration] - reference[iteration]) / reference[iteration] < 1e-5, (
                name,
                values,
                reference,
            )


def test_checkpoint_of_sharded_parameters_loads_under_other_strategies(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Saved with every parameter sharded over DP 2 (--use-megatron-fsdp), loaded whole
    (TP2, nothing sharded) and with sharded gradients over DP 4: the same next losses."""
    ckpt = str(tmp_path / "ckpt")
    common = {"--hidden-dropout": "0.0", "--attention-dropout": "0.0", "--train-iters": "5"}
    original = {"--use-megatron-fsdp": True}
    args = base_args(dataset_prefix, tokenizer_model, **common, **original)
    pretrain(2, args + ["--save", ckpt, "--exit-interval", "3"])
    layouts = {
        "original": (2, original),
        "tp2-whole": (2, {"--tensor-model-parallel-size": "2"}),
        "dp4-sharded-grads": (
            4,
            {"--use-megatron-fsdp": True, "--data-parallel-sharding-strategy": "optim_grads"},
        ),
    }
    results = {}
    for name, (world, layout) in layouts.items():
        log = str(tmp_path / f"{name}.jsonl")
        extra = {"--load": ckpt, "--log-jsonl": log}
        pretrain(world, base_args(dataset_prefix, tokenizer_model, **common, **layout, **extra))
        results[name] = losses(log)
    reference = results.pop("original")
    assert sorted(reference) == [4, 5]
    for name, values in results.items():
        for iteration in (4, 5):
            error = abs(values[iteration] - reference[iteration]) / reference[iteration]
            assert error < 1e-5, (name, iteration, values, reference)


def _pretrain_counting_reads(rank, world, argv):
    """main(argv) on this rank, counting the data iterators it builds."""
    from engine.data.indexed import split
    from engine.pretrain import main

    built = []
    real = split.build_data_iterator
    split.build_data_iterator = lambda *a, **k: built.append(1) or real(*a, **k)
    main(argv)
    return len(built)


def test_only_the_first_and_last_pipeline_stages_read_batches(
    dataset_prefix, tokenizer_model, tmp_path
):
    """PP 4: the two middle stages build no data iterator, and the losses are PP 1's."""
    common = {"--hidden-dropout": "0.0", "--attention-dropout": "0.0", "--train-iters": "3"}
    logs = {}
    for pp in (1, 4):
        log = str(tmp_path / f"pp{pp}.jsonl")
        extra = {"--pipeline-model-parallel-size": str(pp), "--log-jsonl": log}
        argv = base_args(dataset_prefix, tokenizer_model, **common, **extra)
        reads = run_ranks(_pretrain_counting_reads, pp, argv, timeout=300)
        logs[pp] = losses(log)
    assert reads[0] > 0 and reads[3] > 0 and reads[1] == reads[2] == 0, reads
    assert sorted(logs[4]) == [1, 2, 3]
    for iteration, loss in logs[1].items():
        assert abs(logs[4][iteration] - loss) / loss < 1e-5, (logs, iteration)


def _torchrun(args, env_extra, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ONLY, **env_extra)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port, picked by torchrun's rendezvous while binding it
        "--nproc-per-node",
        "2",
        "-m",
        "engine.pretrain",
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


def test_rank_killed_during_save_keeps_previous_checkpoint(
    dataset_prefix, tokenizer_model, tmp_path
):
    ckpt = str(tmp_path / "ckpt")
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--train-iters": "12",
            "--save": ckpt,
            "--save-interval": "4",
            "--log-jsonl": str(tmp_path / "first.jsonl"),
        },
    )
    crashed = _torchrun(args, {"TRIPOD_FAULT_KILL_IN_SAVE": "1:8"})
    assert crashed.returncode != 0
    assert latest(ckpt) == "4"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000008"))
    resumed_args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--train-iters": "12",
            "--save": ckpt,
            "--save-interval": "4",
            "--load": ckpt,
            "--log-jsonl": str(tmp_path / "second.jsonl"),
        },
    )
    resumed = _torchrun(resumed_args, {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "iter_0000004" in resumed.stdout
    first, second = losses(tmp_path / "first.jsonl"), losses(tmp_path / "second.jsonl")
    assert sorted(second) == list(range(5, 13))
    for iteration in range(5, 9):  # what the crashed run had computed, reproduced exactly
        assert second[iteration] == first[iteration]
    assert not any(name.endswith(".tmp") for name in os.listdir(ckpt))


@pytest.mark.parametrize("fault", ["TRIPOD_FAULT_RAISE_AT", "TRIPOD_FAULT_KILL_AT"])
def test_failure_on_one_rank_ends_every_rank(dataset_prefix, tokenizer_model, fault):
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{"--distributed-timeout-minutes": "1", "--train-iters": "50"},
    )
    result = _torchrun(args, {fault: "1:3"}, timeout=180)
    assert result.returncode != 0
    if fault == "TRIPOD_FAULT_RAISE_AT":
        assert "rank 1 failed" in result.stderr and "injected failure" in result.stderr
    else:
        assert "local_rank: 1" in result.stderr or "rank 1" in result.stderr
    assert "iteration     50" not in result.stdout


def test_nan_gradients_are_skipped_counted_and_stop_the_run(
    dataset_prefix, tokenizer_model, tmp_path
):
    log = str(tmp_path / "nan.jsonl")
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--log-jsonl": log,
            "--exit-on-nan-count": "2",
            "--save": str(tmp_path / "ckpt"),
            "--save-interval": "2",
        },
    )
    codes = pretrain(2, args, {"TRIPOD_FAULT_NAN_GRAD_AT": "3,5"})
    assert codes == [1, 1]  # stopped cleanly after the second NaN
    found = records(log)
    by_iter = {r["iteration"]: r for r in found if "split" not in r}
    assert sorted(by_iter) == [1, 2, 3, 4, 5]
    assert [by_iter[i]["skipped_iters"] for i in range(1, 6)] == [0, 0, 1, 1, 2]
    assert by_iter[3]["grad_norm"] is None and by_iter[4]["grad_norm"] is not None
    assert latest(tmp_path / "ckpt") == "4"


def test_loss_spike_is_detected_and_its_update_skipped(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    log = str(tmp_path / "spike.jsonl")
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--log-jsonl": log,
            "--train-iters": "16",
            "--spike-window": "10",
            "--spike-zscore": "3",
            "--skip-spike-batches": True,
            "--hidden-dropout": "0.0",
            "--attention-dropout": "0.0",
            "--lr": "1e-3",
            "--lr-warmup-iters": "0",
            "--vocab-size": "4000",
        },
    )
    pretrain(1, args, {"TRIPOD_FAULT_RANDOM_BATCH_AT": "15"})
    by_iter = {r["iteration"]: r for r in records(log) if "split" not in r}
    assert by_iter[14]["skipped_iters"] == 0 and by_iter[15]["skipped_iters"] == 1
    assert by_iter[15]["lm_loss"] > by_iter[14]["lm_loss"] + 0.2
    assert "loss spike at iteration 15" in capfd.readouterr().out


def test_spike_detector():
    detector = SpikeDetector(window=20, zscore=4.0)
    for i in range(30):
        assert detector.check(5.0 - 0.01 * i + 0.02 * (i % 3)) is None
    assert detector.check(9.0) is not None
    assert detector.check(float("nan")) is None
    assert detector.check(4.7) is None  # back to normal


def test_metrics_tensorboard_plot_and_peak_memory(dataset_prefix, tokenizer_model, tmp_path, capfd):
    log, tb = str(tmp_path / "m.jsonl"), str(tmp_path / "tb")
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--log-jsonl": log,
            "--tensorboard-dir": tb,
            "--train-iters": "6",
            "--log-interval": "2",
            "--eval-interval": "3",
            "--eval-iters": "2",
        },
    )
    pretrain(2, args)
    found = records(log)
    train_records = [r for r in found if "split" not in r]
    keys = {
        "iteration",
        "consumed_samples",
        "lm_loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "skipped_iters",
        "tokens_per_sec",
        "tflops_per_device",
        "mem_gb",
    }
    assert [r["iteration"] for r in train_records] == [2, 4, 6]
    assert all(keys <= set(r) for r in train_records)
    assert train_records[-1]["consumed_samples"] == 48
    evals = [r for r in found if "split" in r]
    assert [(r["iteration"], r["split"]) for r in evals] == [(3, "valid"), (6, "valid")]
    assert all(r["ppl"] > 1 for r in evals)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    # Megatron-LM's tag names, by iteration and by consumed samples, so its dashboards work
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    megatron = {"lm loss", "learning-rate", "grad-norm", "batch-size", "lm loss validation"}
    assert megatron | {f"{t} vs samples" for t in megatron} <= tags, tags
    assert {"tokens_per_sec", "mem_gb", "lm loss validation ppl"} <= tags
    # as Megatron-LM: each iteration's loss (--tensorboard-log-interval 1), the log line's the
    # mean of its window's
    loss = [(e.step, e.value) for e in events.Scalars("lm loss")]
    by_samples = [(e.step, e.value) for e in events.Scalars("lm loss vs samples")]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in by_samples] == [8, 16, 24, 32, 40, 48]
    pairs = [(loss[i][1] + loss[i + 1][1]) / 2 for i in (0, 2, 4)]
    assert pairs == pytest.approx([r["lm_loss"] for r in train_records], rel=1e-6)
    assert [e.step for e in events.Scalars("tokens_per_sec")] == [2, 4, 6]
    out = capfd.readouterr().out
    assert "peak memory per rank (GB): " in out
    assert "ops: PyTorch" in out and "attention: layers 0-3: sdpa-causal" in out  # start-up
    png = tmp_path / "curve.png"
    subprocess.run(
        [sys.executable, "tools/plot_metrics.py", "--log-jsonl", log, "--output", str(png)],
        check=True,
        cwd=ROOT,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_of_another_model_names_the_tensor(dataset_prefix, tokenizer_model, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pretrain(
        1,
        base_args(
            dataset_prefix,
            tokenizer_model,
            **{"--train-iters": "2", "--lr-warmup-iters": "1", "--save": ckpt},
        ),
    )
    with pytest.raises(AssertionError) as info:
        pretrain(
            1,
            base_args(
                dataset_prefix,
                tokenizer_model,
                **{"--train-iters": "3", "--load": ckpt, "--hidden-size": "64"},
            ),
        )
    message = str(info.value)
    assert CheckpointError.__name__ in message
    assert (
        "tensor embedding.position_embeddings.weight has shape [32, 32] there and [32, 64] here"
        in message
    )


def test_keep_last_n(dataset_prefix, tokenizer_model, tmp_path):
    ckpt = tmp_path / "ckpt"
    pretrain(
        1,
        base_args(
            dataset_prefix,
            tokenizer_model,
            **{
                "--train-iters": "6",
                "--save": str(ckpt),
                "--save-interval": "1",
                "--keep-last-n": "2",
            },
        ),
    )
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [
        "iter_0000005",
        "iter_0000006",
    ]


def test_exit_on_missing_checkpoint(tmp_path):
    from engine.errors import ConfigError
    from engine.pretrain import parse
    from engine.train.preflight import prepare
    from tests.test_megatron_flags import SHAPE

    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    prepare(parse(SHAPE + ["--load", empty]), 1)  # starts from scratch
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint: no checkpoint in"):
        prepare(parse(SHAPE + ["--load", empty, "--exit-on-missing-checkpoint"]), 1)


def test_save_retain_interval(dataset_prefix, tokenizer_model, tmp_path):
    """Megatron-LM's meaning: the multiples of the interval and the newest are kept."""
    ckpt = tmp_path / "ckpt"
    extra = {"--train-iters": "7", "--save": str(ckpt), "--save-interval": "1"}
    pretrain(
        1, base_args(dataset_prefix, tokenizer_model, **extra, **{"--save-retain-interval": "3"})
    )
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000007",
    ]


def _cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "engine.pretrain", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, **CPU_ONLY, **(env or {})),
    )


def test_command_line_errors_are_one_line_before_any_process_group(dataset_prefix, tokenizer_model):
    """A mistake of each kind through the command line (a flag, the layout from the launcher's
    environment, the data); the other checks are the same functions, called in this process
    below."""
    good = base_args(dataset_prefix, tokenizer_model)
    cases = [
        (["--hidden-sise", "8"], {}, "unrecognized arguments: --hidden-sise"),
        (
            ["--tensor-model-parallel-size", "2"],
            {"WORLD_SIZE": "3", "RANK": "0"},
            "world size 3 is not divisible by tensor-model-parallel-size 2",
        ),
        (["--data-path", "/nonexistent/prefix"], {}, "/nonexistent/prefix.idx: no such file"),
    ]
    for extra, env, message in cases:
        result = _cli(good + extra, env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (extra, result.stderr)
        assert len(lines) == 1 and message in lines[0], (extra, result.stderr)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--bf16", "--fp16"], "--bf16 and --fp16 contradict each other"),
        (["--global-batch-size", "7"], "global batch 7 is not divisible"),
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed"),
        (["--overlap-p2p-communication"],
         "--overlap-p2p-communication runs with the interleaved schedule only"),
        (["--mock-data"], "--mock-data generates its documents; drop --data-path"),
        (["--trust-remote-code"], "--trust-remote-code: this engine never runs code"),
        (["--tokenizer-type", "NullTokenizer"],
         "--tokenizer-type NullTokenizer needs --vocab-size N"),
        (["--fp8-format", "hybrid", "--first-last-layers-bf16"],
         "--first-last-layers-bf16 with --fp8-recipe delayed"),
        (["--fp8-format", "e4m3", "--fp8-amax-history-len", "0"],
         "--fp8-amax-history-len 0 must be at least 1"),
        (["--fp8-format", "e4m3", "--fp8-param-gather"],
         "--fp8-param-gather needs --use-distributed-optimizer"),
        (["--fp8-format", "e4m3", "--fp8-param-gather", "--use-distributed-optimizer",
          "--fp8-recipe", "mxfp8"], "--fp8-param-gather with --fp8-recipe mxfp8 is not built"),
        (["--fp8-format", "e4m3", "--fp8-param-gather", "--use-distributed-optimizer",
          "--fp16"], "--fp8-param-gather with --fp16: a small weight's FP8 values"),
        (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
        (["--fp8-backend", "torchao"], "--fp8-backend torchao needs --fp8-format"),
        (["--fp8-format", "e4m3", "--fp8-backend", "torchao", "--fp8-recipe", "mxfp8"],
         "--fp8-backend torchao with --fp8-recipe mxfp8: torchao's float8 training"),
        (["--fp8-format", "e4m3", "--fp8-backend", "transformer_engine"],
         "--fp8-backend transformer_engine: Transformer Engine's FP8 layers are not wired"),
        (["--muon-momentum", "0.95"], "--muon-momentum goes with --optimizer muon, not adam"),
        (["--muon-no-split-qkv"], "--muon-no-split-qkv goes with --optimizer muon"),
        (["--optimizer", "muon", "--muon-momentum", "1.0"], "--muon-momentum 1.0 must lie in"),
        (["--optimizer", "muon", "--muon-num-ns-steps", "0"], "--muon-num-ns-steps 0 must be"),
        (["--optimizer", "muon", "--fp16"], "--optimizer muon with --fp16"),
        (["--fp8-format", "e4m3", "--fp8-recipe", "custom"], "--fp8-recipe custom takes"),
        (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--first-last-layers-bf16",
          "--num-layers-at-end-in-bf16", "9"], "--num-layers-at-end-in-bf16 9 must lie in 0..4"),
    ],
)  # fmt: skip
def test_each_configuration_mistake_is_one_line(dataset_prefix, tokenizer_model, extra, message):
    from engine.errors import UserError
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    with pytest.raises(UserError) as found:
        prepare(parse(base_args(dataset_prefix, tokenizer_model) + extra), 1)
    assert message in str(found.value) and "\n" not in str(found.value)


def test_help_lists_flags_in_groups():
    result = _cli(["--help"])
    assert result.returncode == 0
    for group in (
        "model:",
        "parallelism:",
        "optimizer, learning rate, loss scaling:",
        "data:",
        "training length and batch:",
        "device, precision and kernels:",
        "evaluation:",
        "logging:",
        "checkpoints:",
        "exit conditions and skipped steps:",
        "profiling:",
        "tokenizer:",
    ):
        assert group in result.stdout
    for flag in (
        "--tensor-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--use-distributed-optimizer",
        "--recompute-granularity",
        "--lr-decay-style",
        "--tensorboard-dir",
        "--exit-on-nan-count",
        "--mock-data",
        "--tiktoken-pattern",
        "--null-tokenizer-eod-id",
        "--merge-file",
    ):
        assert flag in result.stdout


def test_end_to_end_through_the_launcher(dataset_prefix, tokenizer_model, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        os.symlink(dataset_prefix + suffix, data / f"stdlib_text_document{suffix}")
    os.symlink(tokenizer_model, data / "tokenizer.model")
    env = dict(
        os.environ,
        **CPU_ONLY,
        NPROC_PER_NODE="2",
        DATA=str(data),
        PYTHON=sys.executable,
    )
    env.pop("MASTER_PORT", None)  # torchrun's --standalone picks a free port
    result = subprocess.run(
        [
            "bash",
            "examples/pretrain_gpt.sh",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--seq-length",
            "64",
            "--max-position-embeddings",
            "64",
            "--train-iters",
            "6",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--log-interval",
            "3",
            "--split",
            "'90,10,0'",  # quoted, as Megatron-LM's scripts' word splitting passes it
            "--lr-warmup-iters",
            "1",
            "--save",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "iteration      6/6" in result.stdout and "valid at iteration 6" in result.stdout
    assert (tmp_path / "ckpt" / "iter_0000006" / "meta.json").exists()


def test_evaluations_read_on_through_the_valid_split(dataset_prefix, tokenizer_model, tmp_path):
    """As Megatron-LM: each evaluation reads the valid split's next --eval-iters batches (with
    --lr 0 the model stays put, so only the batches change the loss), also across a resume,
    whose checkpoint carries the count; the test split is read from its start."""
    flags = {"--lr": "0", "--min-lr": "0", "--lr-warmup-iters": None, "--train-iters": "6"}
    flags |= {"--eval-interval": "1", "--eval-iters": "1"}

    def evaluations(log):
        return [r["lm_loss"] for r in records(log) if r.get("split") == "valid"]

    straight = str(tmp_path / "straight.jsonl")
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **flags, **{"--log-jsonl": straight}))
    losses = evaluations(straight)
    assert len(losses) == 6 and len(set(losses)) == 6  # five in the loop, one at the end
    ckpt, parts = str(tmp_path / "ckpt"), str(tmp_path / "parts.jsonl")
    first = {"--save": ckpt, "--exit-interval": "3", "--log-jsonl": parts}
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **flags, **first))
    meta = json.loads(read(os.path.join(ckpt, "iter_0000003", "meta.json")))
    assert meta["counters"]["consumed_valid_samples"] == 3 * 8
    rest = {"--load": ckpt, "--log-jsonl": parts}
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **flags, **rest))
    assert evaluations(parts) == losses
