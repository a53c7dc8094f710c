"""--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler: what a resume does
when the checkpoint's learning-rate schedule differs from the command line's, held to
megatron-core's OptimizerParamScheduler (the same saved state, the same refusals, the same
learning rates and weight decay afterwards), then through a run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from engine.config.optimizer import OptimizerConfig
from engine.errors import ConfigError
from engine.optim.lr_schedule import LRScheduler
from tests import test_optim as optim_tests
from tests.cli import CPU_ONLY
from tests.requirements import require
from tests.test_training import ROOT, base_args, pretrain, records

BATCH, ITERS, DONE = 8, 20, 5
BASE = OptimizerConfig(
    lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, lr_decay_style="cosine", weight_decay=0.01
)
CHANGES = {
    "same": ({}, ITERS),
    "lr": ({"lr": 1e-3}, ITERS),
    "min_lr": ({"min_lr": 0.0}, ITERS),
    "warmup": ({"lr_warmup_iters": 4}, ITERS),
    "warmup_fraction": ({"lr_warmup_iters": 0, "lr_warmup_fraction": 0.25}, ITERS),
    "decay_iters": ({"lr_decay_iters": 30}, ITERS),
    "longer_run": ({}, 40),
    "style": ({"lr_decay_style": "linear"}, ITERS),
    "weight_decay": ({"weight_decay": 0.1}, ITERS),
}
POLICIES = {"neither": {}, "use_checkpoint": {"use": True}, "override": {"override": True}}


def megatron_scheduler(cfg: OptimizerConfig, train_iters: int, use=False, override=False):
    """megatron-core's scheduler built as Megatron-LM's training.py builds it for a run by
    iterations (tests/test_optim.py)."""
    return optim_tests.megatron_scheduler(
        cfg,
        train_iters,
        BATCH,
        use_checkpoint_opt_param_scheduler=use,
        override_opt_param_scheduler=override,
    )


def test_saved_schedule_has_megatron_cores_names_and_values():
    require("megatron.core")
    for cfg in (BASE, dataclasses.replace(BASE, lr_warmup_iters=0, lr_warmup_fraction=0.25)):
        ours, theirs = LRScheduler(cfg, ITERS, BATCH), megatron_scheduler(cfg, ITERS)
        for _ in range(DONE):
            ours.advance()
            theirs.step(BATCH)
        saved, expected = ours.state_dict(), theirs.state_dict()
        assert saved.pop("num_samples") == expected.pop("num_steps")
        assert saved.pop("num_steps") == DONE
        assert saved == expected


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("change", CHANGES)
def test_resume_refuses_takes_or_overrides_as_megatron_core(change, policy):
    require("megatron.core")
    changes, iters = CHANGES[change]
    cfg = dataclasses.replace(BASE, **changes)
    flags = POLICIES[policy]
    saved_ours, saved_theirs = LRScheduler(BASE, ITERS, BATCH), megatron_scheduler(BASE, ITERS)
    for _ in range(DONE):
        saved_ours.advance()
        saved_theirs.step(BATCH)
    # our checkpoint's state, and a Megatron-LM checkpoint's as its resume passes it
    megatron_state = dict(saved_theirs.state_dict(), num_steps=DONE, num_samples=DONE * BATCH)
    refusals = []
    for state in (saved_ours.state_dict(), megatron_state):
        theirs, ours = megatron_scheduler(cfg, iters, **flags), LRScheduler(cfg, iters, BATCH)
        policy_of = {"use_checkpoint": "use" in flags, "override": "override" in flags}
        try:
            theirs.load_state_dict(saved_theirs.state_dict())
        except AssertionError:
            refusals.append(state)
            with pytest.raises(ConfigError, match="--override-opt_param-scheduler"):
                ours.load_state_dict(state, **policy_of)
            continue
        ours.load_state_dict(state, **policy_of)
        # what the next checkpoint saves: megatron-core's state after the same load
        after, expected = ours.state_dict(), theirs.state_dict()
        assert after.pop("num_samples") == expected.pop("num_steps")
        after.pop("num_steps")
        assert after == expected
        group = theirs.optimizer.param_groups[0]
        for step in range(DONE, iters):
            assert ours.lr == pytest.approx(group["lr"], rel=1e-12, abs=1e-15), step
            # megatron-core's load sets its groups' weight decay before it reads the
            # checkpoint's, so its first update after a resume decays by the command line's;
            # tripod takes the checkpoint's from the first
            if step == DONE and policy == "use_checkpoint":
                assert ours.weight_decay == BASE.weight_decay  # the checkpoint's
            else:
                assert ours.weight_decay == group["weight_decay"], step
            ours.advance()
            theirs.step(BATCH)
    # every change is a difference megatron-core refuses without either flag, and only then
    assert bool(refusals) == (change != "same" and policy == "neither")


def test_both_flags_are_refused():
    cfg = dataclasses.replace(
        BASE, use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True
    )
    with pytest.raises(ConfigError, match="give one"):
        cfg.validate(ITERS)


def test_resume_with_another_schedule_through_a_run(dataset_prefix, tokenizer_model, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    first = {"--train-iters": "4", "--save": str(ckpt), "--save-interval": "4"}
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **first))
    longer = {"--train-iters": "8", "--load": str(ckpt), "--log-jsonl": str(log)}
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.pretrain",
            *base_args(dataset_prefix, tokenizer_model, **longer),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, **CPU_ONLY),
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = [
        line for line in refused.stderr.splitlines() if "--override-opt_param-scheduler" in line
    ]
    assert len(lines) == 1 and "lr_decay_steps is 64 samples here and 32 samples in" in lines[0]
    # (and the lock the run held on the folder, engine/checkpoint/run_lock.py)
    assert sorted(os.listdir(ckpt)) == [
        ".run.lock",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    # the checkpoint's schedule: decayed to --min-lr at iteration 4, so the rest runs at it
    taken = dict(longer, **{"--use-checkpoint-opt_param-scheduler": True})
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **taken))
    lrs = [r["lr"] for r in records(log) if "split" not in r]
    assert lrs and all(lr == pytest.approx(3e-4) for lr in lrs)
    # the command line's: decaying over 8 iterations from where the run is
    os.remove(log)
    kept = dict(longer, **{"--override-opt_param-scheduler": True})
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **kept))
    expected = LRScheduler(BASE.__class__(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2), 8, 8)
    want = [expected.lr_at(step) for step in range(4, 8)]
    lrs = [r["lr"] for r in records(log) if "split" not in r]
    assert lrs == pytest.approx(want)


def test_older_megatron_names_are_read_as_megatron_core_reads_them():
    require("megatron.core")
    saved = megatron_scheduler(BASE, ITERS)
    saved.step(DONE * BATCH)
    state = saved.state_dict()
    renamed = {
        "start_lr": state["max_lr"],
        "min_lr": state["min_lr"],
        "warmup_iter": state["lr_warmup_steps"],
        "end_iter": state["lr_decay_steps"],
        "decay_style": state["lr_decay_style"],
        "num_iters": state["num_steps"],
    }
    for cfg, refused in ((BASE, False), (dataclasses.replace(BASE, lr_warmup_iters=4), True)):
        theirs = megatron_scheduler(cfg, ITERS)
        try:
            theirs.load_state_dict(dict(renamed))
            took = True
        except AssertionError:
            took = False
        assert took != refused  # megatron-core's answer, which ours must give
        ours = LRScheduler(cfg, ITERS, BATCH)
        if refused:
            with pytest.raises(ConfigError, match="lr_warmup_steps is 32 samples here and 16"):
                ours.load_state_dict(dict(renamed, num_samples=DONE * BATCH))
        else:
            ours.load_state_dict(dict(renamed, num_samples=DONE * BATCH))
            assert ours.lr == pytest.approx(theirs.optimizer.param_groups[0]["lr"], rel=1e-12)


def _weight_decay_of_groups(rank, world):
    from engine.pretrain import parse
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    argv = [
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2"),
        *("--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer"),
        *("--vocab-size", "64", "--weight-decay", "0.1", "--num-workers", "0"),
    ]
    run = setup(prepare(parse(argv), world), ParallelState.build(1, 1))
    run.scheduler.weight_decay = 0.3  # as a checkpoint's taken by the flag
    run.scheduler.apply(run.optimizer)
    groups = run.optimizer.optimizer.param_groups
    return [(bool(g.get("decays")), g["weight_decay"], len(g["params"])) for g in groups]


def test_the_weight_decay_taken_reaches_only_the_decaying_groups():
    """The weights' groups decay by the checkpoint's value; the biases' and norms' stay at 0."""
    from tests.distributed import run_ranks

    [groups] = run_ranks(_weight_decay_of_groups, 1)
    assert {(decays, wd) for decays, wd, _ in groups} == {(True, 0.3), (False, 0.0)}
