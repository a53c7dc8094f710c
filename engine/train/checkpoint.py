"""Checkpoints of a training run: resuming from --load and saving to --save."""

from __future__ import annotations

import dataclasses

from engine.checkpoint.files import find_latest, iteration_dir
from engine.checkpoint.load import load_checkpoint
from engine.config.tokenizer import tokenizer_record
from engine.data.mix.schedule import check_resumed_schedule
from engine.errors import CheckpointError
from engine.interop.megatron.checkpoint import load_weights, megatron_latest, megatron_progress
from engine.ops.fp8.apply import delayed_states
from engine.train.data_skips import DataWindow
from engine.train.finite_weights import stop_on_non_finite_weights
from engine.train.state import Counters, Run, layout_of
from parallel.random import model_parallel_seed


def resume(run: Run) -> None:
    """Load the latest checkpoint of --load into the run (as --finetune, --no-load-optim and
    --no-load-rng say)."""
    checkpointing = run.cfg.checkpointing
    megatron = megatron_latest(checkpointing.load)
    if megatron is not None:
        _resume_from_megatron(run, megatron)
        return
    iteration = find_latest(checkpointing.load)
    if iteration is None:
        run.writer.print(f"no checkpoint in {checkpointing.load}; starting from scratch")
        return
    path = iteration_dir(checkpointing.load, iteration)
    # As Megatron-LM: --finetune takes the weights alone; --no-load-optim leaves out the
    # optimizer, its loss scaler and the learning-rate schedule; --no-load-rng the RNG.
    load_optimizer = not (checkpointing.finetune or checkpointing.no_load_optim)
    load_rng = not (checkpointing.finetune or checkpointing.no_load_rng)
    meta = read_into_model(run, path, load_optimizer, load_rng)
    if checkpointing.finetune:
        run.writer.print(f"fine-tuning from the weights of {path}; starting at iteration 0")
        reseed(run, 0)
        return
    restore_progress(run, meta, path, load_optimizer)
    if not meta["rng_restored"]:
        how = "with re-seeded random streams (" + (
            "--no-load-rng)" if checkpointing.no_load_rng else "new layout)"
        )
    else:
        how = "exactly"
    if not load_optimizer:
        how += "; optimizer and learning-rate schedule start afresh (--no-load-optim)"
    checked = (
        "files verified"
        if meta["verified"]
        else "checksums not compared (--no-verify)"
        if "files" in meta
        else "no checksums recorded in this older checkpoint"
    )
    run.writer.print(f"resumed from {path} at iteration {meta['iteration']} ({how}; {checked})")
    if not meta["rng_restored"]:
        reseed(run, meta["iteration"])


def read_into_model(run: Run, path: str, load_optimizer: bool, load_rng: bool) -> dict:
    """The checkpoint at `path` read into the model (and optimizer, RNG); its meta.json."""
    checkpointing = run.cfg.checkpointing
    meta = load_checkpoint(
        path,
        run.chunks,
        run.optimizer,
        run.state.rank,
        layout_of(run.state, run.cfg),
        run.progress.tracker,
        group=run.checkpoint_group,
        load_optimizer=load_optimizer,
        verify=checkpointing.verify_checkpoint,
        load_rng=load_rng,
        strictness=checkpointing.dist_ckpt_strictness,
    )
    _log_mismatch(run, path, meta["mismatch"])
    _weights_loaded(run)
    # (converted checkpoints, and ours before the key, do not say: not compared)
    saved_with = meta.get("optimizer", run.cfg.optimizer.optimizer)
    if load_optimizer and saved_with != run.cfg.optimizer.optimizer:
        raise CheckpointError(
            f"{path} holds the state of --optimizer {saved_with}, and this run asks for "
            f"--optimizer {run.cfg.optimizer.optimizer}; give --no-load-optim to start the "
            f"optimizer afresh from its weights, or --optimizer {saved_with}"
        )
    return meta


def restore_progress(run: Run, meta: dict, path: str, load_optimizer: bool) -> None:
    """The run's counters, learning-rate schedule, loss scale, spike history, data position
    and skipped data windows as the checkpoint `meta` holds them."""
    mix_now = run.mix.record() if run.mix is not None else None
    check_resumed_schedule(meta.get("mix"), mix_now, meta["iteration"])
    counters = meta.get("counters", {})
    run.progress.counters = Counters(
        iteration=meta["iteration"],
        consumed_samples=meta["consumed_samples"],
        skipped_iters=counters.get("skipped_iters", 0),
        nan_iters=counters.get("nan_iters", 0),
        consumed_valid_samples=counters.get("consumed_valid_samples", 0),
        optimizer_step=meta.get("optimizer_step", 0) if load_optimizer else 0,
    )
    if load_optimizer:
        _resume_schedule(run, meta["scheduler"], path)
        if run.optimizer.grad_scaler is not None and meta.get("grad_scaler"):
            run.optimizer.grad_scaler.load_state_dict(meta["grad_scaler"])
    run.spikes.load_state_dict(meta.get("spikes", {}))
    run.progress.data_state = meta.get("data")
    run.progress.skipped_data = [DataWindow.from_record(r) for r in meta.get("skipped_data", [])]
    run.progress.weights_checked = None


def _weights_loaded(run: Run) -> None:
    """After a checkpoint's weights were read: nothing recorded yet for delayed scaling's step
    to come (as at a step's end: the weights' FP8 gather at the start recorded their amax),
    and the masters published into the weights, as a step ends (gathered in FP8 with
    --fp8-param-gather, which records the weights' amax again)."""
    for delayed in delayed_states(run.chunks):
        delayed.amax_now.zero_()
    run.optimizer.publish_weights()


def _resume_from_megatron(run: Run, path: str) -> None:
    """--load of a Megatron-LM torch_dist checkpoint: its weights (any layout), and unless
    --finetune its iteration, consumed samples and (unless --no-load-optim) learning-rate
    schedule and Adam state (when it holds one; otherwise the optimizer starts from the
    weights, and the resume line says so)."""
    checkpointing = run.cfg.checkpointing
    load_optimizer = not (checkpointing.finetune or checkpointing.no_load_optim)
    step = load_weights(path, run.chunks, run.cfg.model, run.optimizer, load_optimizer)
    _weights_loaded(run)
    if checkpointing.finetune:
        run.writer.print(f"fine-tuning from the weights of Megatron-LM's {path}; iteration 0")
        reseed(run, 0)
        return
    saved = megatron_progress(path)
    run.progress.counters = Counters(
        iteration=saved["iteration"],
        consumed_samples=saved["consumed_samples"],
        optimizer_step=step or 0,
    )
    if load_optimizer:
        schedule = dict(saved["schedule"])  # its num_steps counts samples, as ours num_samples
        schedule.update(num_steps=saved["iteration"], num_samples=saved["schedule_samples"])
        _resume_schedule(run, schedule, f"Megatron-LM's {path}")
    if step is not None:
        optim = f"Adam state at step {step}"
    elif load_optimizer:
        optim = "it holds no optimizer state, so the optimizer starts afresh from the weights"
    else:
        optim = "the optimizer starts afresh (--no-load-optim)"
    run.writer.print(
        f"resumed from Megatron-LM's {path} at iteration {saved['iteration']} (weights, "
        f"samples consumed and learning-rate schedule; {optim}; random streams re-seeded)"
    )
    run.progress.last_saved = saved["iteration"]  # its folder is Megatron-LM's: never re-saved
    reseed(run, saved["iteration"])


def _log_mismatch(run: Run, path: str, mismatch: dict) -> None:
    """--dist-ckpt-strictness log_unexpected / log_all: the tensors that did not match."""
    strictness = run.cfg.checkpointing.dist_ckpt_strictness
    told = {"log_unexpected": ("unexpected",), "log_all": ("unexpected", "missing")}
    meaning = {
        "unexpected": "this model's, not in the checkpoint (left at their initial values)",
        "missing": "the checkpoint's, not in this model (not read)",
    }
    for kind in told.get(strictness, ()):
        if mismatch[kind]:
            names = ", ".join(mismatch[kind])
            run.writer.print(f"warning: {path}: {kind} tensors, {meaning[kind]}: {names}")


def _resume_schedule(run: Run, state: dict, where: str) -> None:
    """The learning-rate schedule's counts, its shape compared with this run's as
    megatron-core compares them (--use-checkpoint-opt_param-scheduler,
    --override-opt_param-scheduler)."""
    cfg = run.cfg.optimizer
    taken = run.scheduler.load_state_dict(
        state,
        use_checkpoint=cfg.use_checkpoint_opt_param_scheduler,
        override=cfg.override_opt_param_scheduler,
        where=where,
    )
    if taken:
        values = ", ".join(f"{key} {state[key]}" for key in taken)
        run.writer.print(f"--use-checkpoint-opt_param-scheduler: from {where}: {values}")


def reseed(run: Run, iteration: int) -> None:
    """Fresh random streams for a run that could not restore the saved ones."""
    seed = run.cfg.training.seed + iteration
    state = run.state
    run.progress.tracker = model_parallel_seed(
        seed, state.tp_rank, state.pp_rank, state.device, state.cp_rank
    )
    for chunk in run.chunks:
        for module in chunk.module.modules():
            if hasattr(module, "ctx"):
                module.ctx.tracker = run.progress.tracker


def save(run: Run) -> None:
    """Checkpoint the run at its current iteration into --save (NonFiniteWeights, and nothing
    written, when a weight is NaN or Inf)."""
    stop_on_non_finite_weights(run, "found before saving")
    c = run.progress.counters
    meta = {
        "consumed_samples": c.consumed_samples,
        "layout": layout_of(run.state, run.cfg),
        "model": dataclasses.asdict(run.cfg.model),
        "dtype": str(run.dtype).replace("torch.", ""),
        "tokenizer": tokenizer_record(run.cfg.tokenizer),
        "tokenizer_identity": run.tokenizer_identity,  # compared on resume (preflight)
        "scheduler": run.scheduler.state_dict(),
        "grad_scaler": run.optimizer.grad_scaler.state_dict()
        if run.optimizer.grad_scaler
        else None,
        "optimizer_step": c.optimizer_step,
        "optimizer": run.cfg.optimizer.optimizer,  # its state's kind, compared on resume
        "counters": {
            "skipped_iters": c.skipped_iters,
            "nan_iters": c.nan_iters,
            "consumed_valid_samples": c.consumed_valid_samples,
        },
        "spikes": run.spikes.state_dict(),
        "skipped_data": [w.record() for w in run.progress.skipped_data],
        "train_split_samples": run.train_split_samples,  # its order depends on it
        # the model/ weights hold FP8 values, the masters the trained ones (export reads those)
        "fp8_param_gather": run.cfg.runtime.fp8_param_gather,
        "run": run.record,  # the configuration, data files and code (rank 0 writes meta)
    }
    if run.mix is not None:  # the blend's weights over the run, compared on resume
        meta["mix"] = run.mix.record()
    if run.packing is not None:  # what evaluation applies as training did (engine/eval/)
        meta["packing"] = dataclasses.asdict(run.packing)
    iterator = run.progress.train_iterator  # rank 0 (a first stage, which reads) writes meta
    position = iterator.state_dict() if iterator is not None else None
    if position is not None:  # a Parquet stream's position beyond the consumed count
        meta["data"] = position
    stall = run.checkpointer.save(
        c.iteration, run.chunks, run.optimizer, meta, run.progress.tracker
    )
    run.progress.last_saved = c.iteration
    kind = "started (async)" if run.checkpointer.async_save else "saved"
    run.writer.print(
        f"checkpoint {kind}: {iteration_dir(run.checkpointer.root, c.iteration)} "
        f"(stalled {stall:.2f}s)"
    )
