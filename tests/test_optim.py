"""The learning-rate schedule against Megatron-LM's own (megatron.core's
OptimizerParamScheduler, installed beside the engine as an independent reference): every
decay style, with and without warm-up, through the decay's end into the --min-lr tail; and
through the real training loop, where a skipped update must not advance the schedule, and a
resumed run must carry on from the count saved in its checkpoint."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.config.optimizer import OptimizerConfig
from engine.errors import ConfigError
from engine.optim.lr_schedule import LRScheduler
from engine.pretrain import parse
from tests.distributed import run_ranks
from tests.harness import engine_steps
from tests.test_training import base_args, pretrain, records

TRAIN_ITERS = 24
GLOBAL_BATCH = 8  # Megatron-LM counts samples; a batch > 1 checks that we count the same way


def megatron_scheduler(
    cfg: OptimizerConfig, train_iters: int, global_batch: int, train_samples=None, **flags
):
    """megatron-core's scheduler for `cfg`, its lengths derived as Megatron-LM's
    get_optimizer_param_scheduler derives them (that function needs megatron.training, which
    is not installed), by iterations or by --train-samples, over one parameter group carrying
    max_lr and min_lr as its optimizer's groups do; `flags`: use_checkpoint_opt_param_scheduler,
    override_opt_param_scheduler."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    param = torch.nn.Parameter(torch.zeros(1))
    group = {"params": [param], "max_lr": cfg.lr, "min_lr": cfg.min_lr}
    optimizer = torch.optim.SGD([group], lr=cfg.lr)
    if train_samples:
        decay = cfg.lr_decay_samples if cfg.lr_decay_samples is not None else train_samples
        wsd = cfg.lr_wsd_decay_samples
        warmup = cfg.lr_warmup_samples
        wd_steps = train_samples
    else:
        decay_iters = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else train_iters
        decay = decay_iters * global_batch
        wsd = None if cfg.lr_wsd_decay_iters is None else cfg.lr_wsd_decay_iters * global_batch
        warmup = cfg.lr_warmup_iters * global_batch
        wd_steps = train_iters * global_batch
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr_warmup_init,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=wd_steps,
        wd_incr_style="constant",
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=cfg.lr_wsd_decay_style,
        **flags,
    )


def megatron_lrs(
    cfg: OptimizerConfig, train_iters: int, global_batch: int, updates: int, train_samples=None
):
    """The LR of updates 0..updates-1 as Megatron-LM's training gets them: the scheduler counts
    samples and steps by a global batch after each successful update."""
    scheduler = megatron_scheduler(cfg, train_iters, global_batch, train_samples)
    lrs = []
    for _ in range(updates):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step(increment=global_batch)
    return lrs


def max_rel_diff(ours: list[float], theirs: list[float]) -> float:
    """Largest |ours - theirs| / |theirs| (the absolute difference where theirs is 0)."""
    assert len(ours) == len(theirs)
    return max(abs(a - b) / abs(b) if b else abs(a) for a, b in zip(ours, theirs, strict=True))


STYLES = [
    ("constant", None),
    ("linear", None),
    ("cosine", None),
    ("inverse-square-root", None),
    ("WSD", "exponential"),
    ("WSD", "linear"),
    ("WSD", "cosine"),
    ("WSD", "minus_sqrt"),
]
# (warm-up iterations, --lr-warmup-init)
WARMUPS = [(0, 0.0), (1, 0.0), (4, 0.0), (4, 2e-4)]


def schedule_config(style, wsd_style, warmup, warmup_init, decay_iters=16) -> OptimizerConfig:
    extra = {"lr_wsd_decay_style": wsd_style, "lr_wsd_decay_iters": 6} if wsd_style else {}
    return OptimizerConfig(
        lr=1e-3,
        min_lr=1e-4,
        lr_decay_style=style,
        lr_decay_iters=decay_iters,  # shorter than the run: the --min-lr tail shows
        lr_warmup_iters=warmup,
        lr_warmup_init=warmup_init,
        **extra,
    )


@pytest.mark.parametrize("warmup, warmup_init", WARMUPS, ids=lambda v: str(v))
@pytest.mark.parametrize("style, wsd_style", STYLES, ids=lambda v: str(v))
def test_schedule_equals_megatron(style, wsd_style, warmup, warmup_init):
    cfg = schedule_config(style, wsd_style, warmup, warmup_init)
    updates = TRAIN_ITERS + 1
    theirs = megatron_lrs(cfg, TRAIN_ITERS, GLOBAL_BATCH, updates)
    scheduler = LRScheduler(cfg, TRAIN_ITERS, global_batch_size=GLOBAL_BATCH)
    ours = []
    for _ in range(updates):
        ours.append(scheduler.lr)
        scheduler.advance()
    assert max_rel_diff(ours, theirs) <= 1e-12, list(zip(ours, theirs, strict=True))
    assert ours == [scheduler.lr_at(k) for k in range(updates)]


def test_schedule_decays_over_train_iters_by_default():
    cfg = schedule_config("cosine", None, 3, 0.0, decay_iters=None)
    theirs = megatron_lrs(cfg, TRAIN_ITERS, GLOBAL_BATCH, TRAIN_ITERS + 2)
    scheduler = LRScheduler(cfg, TRAIN_ITERS, global_batch_size=GLOBAL_BATCH)
    ours = [scheduler.lr_at(k) for k in range(TRAIN_ITERS + 2)]
    assert max_rel_diff(ours, theirs) <= 1e-12


@pytest.mark.parametrize("style, wsd_style", STYLES, ids=lambda v: str(v))
def test_sample_based_schedule_equals_megatron(style, wsd_style):
    """--train-samples with --lr-decay-samples / --lr-warmup-samples (and WSD's samples), as the
    Llama-3 example runs; the samples are not whole batches, so rounding shows."""
    extra = {"lr_wsd_decay_style": wsd_style, "lr_wsd_decay_samples": 45} if wsd_style else {}
    cfg = OptimizerConfig(
        lr=1e-3,
        min_lr=1e-4,
        lr_decay_style=style,
        lr_decay_samples=150,
        lr_warmup_samples=21,
        lr_warmup_init=1e-5,
        **extra,
    )
    train_samples = TRAIN_ITERS * GLOBAL_BATCH + 5
    theirs = megatron_lrs(cfg, None, GLOBAL_BATCH, TRAIN_ITERS, train_samples)
    scheduler = LRScheduler(cfg, TRAIN_ITERS, GLOBAL_BATCH, train_samples)
    ours = [scheduler.lr_at(k) for k in range(TRAIN_ITERS)]
    assert max_rel_diff(ours, theirs) <= 1e-12, list(zip(ours, theirs, strict=True))


@pytest.mark.parametrize("train_samples", [None, TRAIN_ITERS * GLOBAL_BATCH])
def test_warmup_fraction_equals_megatron(train_samples):
    """--lr-warmup-fraction (the GPT-3 example's .001): a share of the decay length, which
    need not be a whole number of samples."""
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_fraction=0.13)
    theirs = megatron_lrs(cfg, TRAIN_ITERS, GLOBAL_BATCH, TRAIN_ITERS + 1, train_samples)
    scheduler = LRScheduler(cfg, TRAIN_ITERS, GLOBAL_BATCH, train_samples)
    ours = [scheduler.lr_at(k) for k in range(TRAIN_ITERS + 1)]
    assert max_rel_diff(ours, theirs) <= 1e-12, list(zip(ours, theirs, strict=True))
    assert 0 < ours[1] < ours[4] == pytest.approx(1e-3, rel=0.01)


@pytest.mark.parametrize(
    "fields, train_samples, message",
    [
        ({"lr_decay_iters": 10}, 100, "--lr-decay-iters goes with --train-iters"),
        ({"lr_warmup_iters": 2}, 100, "--lr-warmup-iters goes with --train-iters"),
        ({"lr_warmup_samples": 8}, None, "--lr-warmup-samples goes with --train-samples"),
        ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 1}, None, "both set the warm-up"),
        ({"lr_warmup_samples": 100}, 100, "--lr-warmup-samples 100"),
        ({"lr_decay_style": "WSD"}, 100, "--lr-wsd-decay-samples"),
    ],
)
def test_iterations_and_samples_do_not_mix(fields, train_samples, message):
    with pytest.raises(ConfigError, match=message):
        LRScheduler(OptimizerConfig(lr=1e-3, **fields), 10, 10, train_samples)


def test_warmup_starts_at_init_and_reaches_the_peak_after_warmup_iters():
    # The example: --lr-warmup-iters 2 gives 0, lr/2, lr for the first three updates.
    cfg = OptimizerConfig(lr=1e-3, lr_decay_style="constant", lr_warmup_iters=2)
    scheduler = LRScheduler(cfg, 10)
    assert [scheduler.lr_at(k) for k in range(4)] == [0.0, 5e-4, 1e-3, 1e-3]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lr_warmup_iters": 10}, "--lr-warmup-iters 10"),
        ({"lr_decay_iters": 0}, "--lr-decay-iters"),
        ({"lr_warmup_init": 2e-3}, "--lr-warmup-init"),
        ({"lr_decay_style": "WSD"}, "--lr-wsd-decay-iters"),
    ],
)
def test_schedule_settings_megatron_rejects_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        LRScheduler(OptimizerConfig(lr=1e-3, **fields), 10)


SKIPPED = 3  # the update of this iteration (1-based) is skipped: a NaN gradient


def test_skipped_update_does_not_advance_the_schedule(dataset_prefix, tokenizer_model, tmp_path):
    """Iteration SKIPPED's gradient is NaN, so its update is skipped; every logged LR is the one
    Megatron-LM gives for the successful updates before it, straight and after a resume from
    a checkpoint taken after the skip."""
    train_iters = 8
    flags = {
        "--train-iters": str(train_iters),
        "--lr-decay-style": "linear",
        "--lr-warmup-iters": "2",
        "--lr-warmup-init": "1e-3",
        "--lr-decay-iters": "6",
        "--eval-iters": "0",
    }
    ckpt = str(tmp_path / "ckpt")
    straight_log = str(tmp_path / "straight.jsonl")
    args = base_args(dataset_prefix, tokenizer_model, **flags)
    save = {"--log-jsonl": straight_log, "--save": ckpt, "--save-interval": "4"}
    fault = {"TRIPOD_FAULT_NAN_GRAD_AT": str(SKIPPED)}
    assert pretrain(1, base_args(dataset_prefix, tokenizer_model, **flags, **save), fault) == [0]
    # Resume from iteration 4's checkpoint (one update skipped before it).
    at4 = tmp_path / "at4"
    shutil.copytree(iteration_dir(ckpt, 4), at4 / "iter_0000004")
    (at4 / "latest_checkpointed_iteration.txt").write_text("4\n")
    resumed_log = str(tmp_path / "resumed.jsonl")
    resume = {"--log-jsonl": resumed_log, "--load": str(at4)}
    assert pretrain(1, base_args(dataset_prefix, tokenizer_model, **flags, **resume)) == [0]

    straight = {r["iteration"]: r for r in records(straight_log) if "split" not in r}
    resumed = {r["iteration"]: r for r in records(resumed_log) if "split" not in r}
    assert sorted(straight) == list(range(1, train_iters + 1))
    assert sorted(resumed) == list(range(5, train_iters + 1))
    assert [straight[i]["skipped_iters"] for i in (2, 3, 4)] == [0, 1, 1]

    cfg = parse(args)
    theirs = megatron_lrs(cfg.optimizer, train_iters, cfg.training.global_batch_size, train_iters)
    successful_before = {i: i - 1 - (i > SKIPPED) for i in range(1, train_iters + 1)}
    expected = {i: theirs[n] for i, n in successful_before.items()}
    assert {i: r["lr"] for i, r in straight.items()} == pytest.approx(expected, rel=1e-12, abs=0)
    assert {i: r["lr"] for i, r in resumed.items()} == pytest.approx(
        {i: expected[i] for i in resumed}, rel=1e-12, abs=0
    )
    # The skipped iteration logs the LR its update would have used, the next one the same.
    assert straight[SKIPPED]["lr"] == straight[SKIPPED + 1]["lr"]
    # The checkpoint counts successful updates: 3 of the first 4 iterations.
    assert read_meta(iteration_dir(ckpt, 4))["scheduler"]["num_steps"] == 3


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "WSD"])
def test_decoupled_learning_rates_equal_megatron_core(style):
    """--decoupled-lr/--decoupled-min-lr as megatron-core applies them: a param group with its
    own max_lr and min_lr under the same scheduler (the Llama-3 example's values)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wsd = {"lr_wsd_decay_iters": 6} if style == "WSD" else {}
    for decoupled_min in (4.5e-5, None):
        cfg = OptimizerConfig(
            lr=1.5e-4,
            min_lr=1e-5,
            decoupled_lr=5e-4,
            decoupled_min_lr=decoupled_min,
            lr_decay_style=style,
            lr_warmup_iters=4,
            lr_decay_iters=16,
            **wsd,
        )
        ours = LRScheduler(cfg, TRAIN_ITERS, GLOBAL_BATCH)
        main, embedding = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        override = {"max_lr": 5e-4} | ({"min_lr": decoupled_min} if decoupled_min else {})
        optimizer = torch.optim.SGD([{"params": [main]}, {"params": [embedding], **override}])
        theirs = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=4 * GLOBAL_BATCH,
            lr_decay_steps=16 * GLOBAL_BATCH,
            lr_decay_style=style,
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=TRAIN_ITERS * GLOBAL_BATCH,
            wd_incr_style="constant",
            wsd_decay_steps=6 * GLOBAL_BATCH if wsd else None,
            lr_wsd_decay_style=cfg.lr_wsd_decay_style,
        )
        for step in range(TRAIN_ITERS):
            theirs.step(increment=0 if step == 0 else GLOBAL_BATCH)
            samples = step * GLOBAL_BATCH
            assert ours.lr_after(samples) == optimizer.param_groups[0]["lr"], step
            assert ours.lr_after(samples, decoupled=True) == optimizer.param_groups[1]["lr"]


def test_decoupled_lr_trains_the_embeddings_and_output_layer_at_their_own_rate():
    """A run with --decoupled-lr 0: the word embeddings and the (untied) output layer keep
    their initial values, everything else trains; with --decoupled-lr equal to --lr the run
    is the same as without the flag."""
    [(before, after, _, _)] = run_ranks(engine_steps, 1, ["--decoupled-lr", "0"])
    frozen = {n for n in before if torch.equal(before[n], after[n])}
    assert frozen == {"embedding.word_embeddings.weight", "output_layer.weight"}
    [(_, plain, _, _)] = run_ranks(engine_steps, 1, [])
    [(_, same, _, _)] = run_ranks(
        engine_steps, 1, ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "0"]
    )
    assert all(torch.equal(plain[n], same[n]) for n in plain)
