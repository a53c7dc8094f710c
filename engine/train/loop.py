"""The training loop and the end of a run (set-up: engine/train/setup.py; one iteration:
engine/train/iteration.py; evaluation: engine/train/evaluate.py; checkpoints:
engine/train/checkpoint.py; log lines: engine/train/log.py).

Each iteration: the pipeline schedule runs the global batch's micro-batches, gradients are
reduced, the loss is made known to every rank, and the optimizer steps unless the step is
skipped (NaN/Inf, or a spike with --skip-spike-batches; with --exit-on-nan-count the run stops
after that many). Every --log-interval iterations a log line, every --eval-interval an
evaluation, every --save-interval a checkpoint; --exit-interval, --exit-duration-in-mins and a
signal with --exit-signal-handler stop the run cleanly after saving.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.monitor.metrics import memory_gb
from engine.monitor.weight_hash import check_qk_norms, check_replicas
from engine.train import faults
from engine.train.batches import data_iterator, micro_batches_per_step, next_batches
from engine.train.checkpoint import save
from engine.train.data_skips import read_past
from engine.train.evaluate import evaluate
from engine.train.finite_weights import stop_on_non_finite_weights
from engine.train.iteration import IterationResult, train_iteration
from engine.train.log import log_eval, log_iteration, log_samples, log_tasks, log_window
from engine.train.rollback import roll_back
from engine.train.state import Counters, Run


class NaNLimit(Exception):
    """--exit-on-nan-count reached."""


def train(run: Run) -> Counters:
    """The loop from the current counters to --train-iters (or --exit-interval)."""
    state, cfg, progress = run.state, run.cfg, run.progress
    c, times, iterations = progress.counters, run.features.times, cfg.training.train_iters
    iterator = data_iterator(
        state,
        cfg.training.micro_batch_size,
        run.datasets[0],
        c.consumed_samples,
        cfg.data.num_workers,
        progress.data_state,
        run.packing,
    )
    progress.train_iterator = iterator
    window: list[IterationResult] = []
    tokens_since_log = 0
    run.throughput.reset()
    times.take()  # the time breakdown starts with the window
    if run.watchdog is not None:
        run.watchdog.start()
    _beat(run)
    test_mode = cfg.exit.test_mode and cfg.model.qk_layernorm
    if cfg.exit.test_mode and not test_mode:
        run.writer.print("--test-mode: no QK layernorm to compare (as in Megatron-LM)")
    skipped = set(cfg.training.iterations_to_skip)
    while c.iteration < iterations:
        run.profiler.before_iteration(c.iteration)
        if test_mode:
            with times.measure("weight-check"):
                check_qk_norms(
                    run.chunks, state.tp_group, state.world_group, state.device, c.iteration + 1
                )
        _announce_mix_phase(run)
        _skip_data(run, iterator)
        global_batch = run.batches.at(c.consumed_samples)
        count = micro_batches_per_step(cfg.training.micro_batch_size, state, global_batch)
        with times.measure("batch-generator"):
            batches = next_batches(iterator, count, state.device, run.packing)
            faults.while_reading(state.rank)
        if c.iteration in skipped:  # Megatron-LM's count: the step after N completed ones
            c.iteration += 1
            c.consumed_samples += global_batch
            run.writer.print(
                f"iteration {c.iteration}: skipped with its {global_batch} samples "
                f"(--iterations-to-skip {c.iteration - 1})"
            )
            _beat(run)
            continue
        result = train_iteration(run, batches, global_batch)
        _count(c, result)
        _beat(run)
        run.profiler.after_iteration(c.iteration)
        tokens_since_log += global_batch * cfg.model.seq_length
        if result.spike_z is not None:
            action = "update skipped" if cfg.exit.skip_spike_batches else "kept"
            if cfg.exit.rollback_on_spike:
                action = "--rollback-on-spike:"
            run.writer.print(
                f"loss spike at iteration {c.iteration}: {result.lm_loss:.4f} "
                f"(z = {result.spike_z:.1f}); {action}"
            )
            if cfg.exit.rollback_on_spike and roll_back(run, c.iteration, result.spike_z):
                window, tokens_since_log = [], 0
                c = progress.counters  # the checkpoint's
                _beat(run)
                continue
        window.append(result)
        if c.iteration % cfg.logging.tensorboard_log_interval == 0:
            log_iteration(run, result)
        if c.iteration % cfg.logging.log_interval == 0 or c.iteration == iterations:
            log_window(run, window, tokens_since_log)
            window, tokens_since_log = [], 0
            stop_on_non_finite_weights(run, "found at the log line")
        every = cfg.exit.check_weight_hash_across_dp_replicas_interval
        if every and c.iteration % every == 0:
            with times.measure("weight-check"):
                check_replicas(run.chunks, state.world_group, state.device, c.iteration)
            run.writer.print(f"weights equal across data-parallel replicas at {c.iteration}")
        _evaluate_on_schedule(run)
        nan_limit = cfg.exit.exit_on_nan_count
        if nan_limit and c.nan_iters >= nan_limit:
            raise NaNLimit(
                f"stopping at iteration {c.iteration}: {c.nan_iters} iterations with a NaN/Inf "
                f"loss or gradient (--exit-on-nan-count {nan_limit}); checkpoints already saved "
                "are kept"
            )
        stop = bool(cfg.exit.exit_interval) and c.iteration % cfg.exit.exit_interval == 0
        save_every = cfg.checkpointing.save_interval
        if run.checkpointer is not None and (
            stop or (save_every and c.iteration % save_every == 0)
        ):
            with times.measure("save-checkpoint"):
                save(run)
            _beat(run)
        if stop:
            run.writer.print(f"exiting at iteration {c.iteration} (--exit-interval)")
            break
        with times.measure("exit-check"):
            reason = run.exit_conditions.check(state.world_group, state.device)
        if reason:
            if run.checkpointer is not None and progress.last_saved != c.iteration:
                save(run)
            run.writer.print(f"exiting at iteration {c.iteration}: {reason}")
            break
    return c


def _evaluate_on_schedule(run: Run) -> None:
    """--eval-interval's valid split (and --eval-prompts' samples) and --eval-tasks' scores,
    where their intervals fall before the last iteration (the end's are finish()'s)."""
    cfg, c, times = run.cfg, run.progress.counters, run.features.times
    if c.iteration >= cfg.training.train_iters:
        return
    every = cfg.evaluation.eval_tasks_interval or cfg.evaluation.eval_interval
    if run.eval_tasks is not None and every and c.iteration % every == 0:
        with times.measure("evaluate"), times.paused():
            log_tasks(run)
        _beat(run)
    every = cfg.evaluation.eval_interval
    if every and c.iteration % every == 0:
        with times.measure("evaluate"), times.paused():
            log_eval(run, "valid", evaluate(run, 1))
            if run.eval_prompts is not None:
                log_samples(run)
        _beat(run)


def _skip_data(run: Run, iterator) -> None:
    """The data windows that start with the coming iteration, read past (data_skips.py)."""
    progress = run.progress
    pending, coming = progress.pending_skips, progress.counters.iteration + 1
    while pending and pending[0].first <= coming:
        window = read_past(run, iterator, pending.pop(0))
        progress.skipped_data.append(window)
        run.writer.print(f"iteration {coming}: skipping {window.describe()} ({window.cause})")


def _beat(run: Run, state: str = "training") -> None:
    """Progress, for the hang watchdog (--hang-timeout-seconds) and the heartbeat file."""
    if run.watchdog is not None:
        run.watchdog.beat()
    if run.heartbeat is not None:
        c = run.progress.counters
        tokens = c.consumed_samples * run.cfg.model.seq_length
        run.heartbeat.beat(c.iteration, c.consumed_samples, tokens, state)


def _count(c: Counters, result: IterationResult) -> None:
    """The counters after an iteration."""
    c.iteration += 1
    c.consumed_samples += result.batch_size
    c.skipped_iters += not result.updated
    c.optimizer_step += result.updated
    c.nan_iters += result.nan


def _announce_mix_phase(run: Run) -> None:
    """A console line when a phase of --data-mix-schedule starts with this iteration."""
    mix, iteration = run.mix, run.progress.counters.iteration
    if mix is None or iteration == 0 or mix.phase_at(iteration).iteration != iteration:
        return
    phase = mix.phase_at(iteration)
    weights = ", ".join(f"{n} {w:.3g}" for n, w in zip(mix.names, phase.weights, strict=False))
    run.writer.print(
        f"data mix from iteration {iteration} (sample {phase.first_sample}): {weights}"
    )


def finish(run: Run, completed: bool = True) -> None:
    """End of run: valid and test evaluation and a final checkpoint (when the run `completed`
    its iterations rather than stopped on broken weights), peak memory per rank."""
    c = run.progress.counters
    if run.watchdog is not None:  # the final evaluation and save are not watched
        run.watchdog.stop()
    if completed and c.iteration >= run.cfg.training.train_iters:
        log_eval(run, "valid", evaluate(run, 1))
        if run.eval_prompts is not None:
            log_samples(run)
        log_eval(run, "test", evaluate(run, 2))
        if run.eval_tasks is not None:
            log_tasks(run)
        if run.checkpointer is not None and run.progress.last_saved != c.iteration:
            save(run)
    if run.checkpointer is not None:
        run.checkpointer.wait()
        run.checkpointer.release()
    done = completed and c.iteration >= run.cfg.training.train_iters
    if run.heartbeat is not None:
        _beat(run, "finished" if done else "stopped")
    run.exit_conditions.close()
    run.profiler.close()
    peaks = torch.zeros(run.state.world_size, dtype=torch.float64, device=run.state.device)
    peaks[run.state.rank] = memory_gb(run.state.device)
    if run.state.world_group is not None:
        dist.all_reduce(peaks, group=run.state.world_group)
    peaks = peaks.tolist()
    if run.state.rank == 0:
        print("peak memory per rank (GB): " + ", ".join(f"{p:.2f}" for p in peaks), flush=True)
    run.writer.close()
