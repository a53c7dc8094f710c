"""The training loop, its iterations, and evaluation (set-up: engine/train/setup.py; checkpoints:
engine/train/checkpoint.py; log lines: engine/train/log.py).

Each iteration: the pipeline schedule runs the global batch's micro-batches, gradients are
reduced (finalize_model_grads), the loss is made known to every rank, and the optimizer steps
unless the loss or the gradient is NaN/Inf (the step is skipped and counted; with
--exit-on-nan-count the run stops after that many) or, with --skip-spike-batches, the loss is
a spike (z-score over a window of recent losses). A skipped step does not advance the
learning-rate schedule; the "lr" logged is the one the iteration's update used or would have.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.data.loader import WithDomains, build_data_iterator
from engine.data.mix.blended import BlendedDataset
from engine.data.streaming.dataset import StreamingDataset
from engine.eval.samples import log_samples
from engine.monitor.metrics import memory_gb
from engine.train import faults
from engine.train.checkpoint import save
from engine.train.log import log_eval, log_window
from engine.train.state import Counters, Run
from engine.train.step import domain_losses, eval_step, train_step


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def domain_names(dataset) -> tuple[str, ...]:
    """The names of the datasets a split blends, when it blends several (their losses are
    reported one by one); () otherwise."""
    names = getattr(dataset, "names", ())
    return names if len(names) > 1 else ()


def micro_batches_per_step(run: Run, global_batch: int) -> int:
    """This DP rank's micro-batches in a step of `global_batch` samples."""
    return global_batch // (run.cfg.training.micro_batch_size * run.state.dp_size)


def train_iteration(run: Run, batches: list[dict], global_batch: int | None = None) -> dict:
    """One optimizer step over `batches` (this rank's micro-batches of a global batch of
    `global_batch` samples, by default the run's final one), or a skipped step (NaN/Inf loss or
    gradient, or a loss spike with --skip-spike-batches). Collective on every rank; every rank
    decides the same."""
    global_batch = global_batch or run.batches.final
    rank, iteration = run.state.rank, run.counters.iteration + 1
    faults.before_iteration(rank, iteration, batches, run.cfg.model.vocab_size)
    decision = {"spike_z": None, "attempted": False}

    def should_step(loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        decision["spike_z"] = run.spikes.check(loss)
        decision["attempted"] = decision["spike_z"] is None or not run.cfg.exit.skip_spike_batches
        return decision["attempted"]

    every = run.cfg.logging.log_grad_norms_interval
    parts = run.norm_parts if every and iteration % every == 0 else None
    names = domain_names(run.datasets[0])
    out = train_step(
        run.chunks,
        run.optimizer,
        run.scheduler,
        batches,
        run.state,
        run.schedule,
        after_backward=lambda: faults.after_backward(rank, iteration, run.chunks),
        should_step=should_step,
        before_update=run.checkpointer.wait_for_copy if run.checkpointer else None,
        samples=global_batch,
        norm_parts=parts,
        local_squares=run.local_squares,
        num_domains=len(names),
        times=run.times,
    )
    # An attempted step that did not update had a non-finite gradient (with fp16 that is a
    # loss-scale overflow, which the scaler handles and is not counted).
    bad_gradient = decision["attempted"] and not out.updated and run.optimizer.grad_scaler is None
    noise_scale = None
    if run.noise_scale is not None and out.grad_norm is not None:
        own_batch = global_batch // run.state.dp_size
        noise_scale = run.noise_scale.update(
            out.local_grad_squares, own_batch, out.grad_norm**2, global_batch
        )
    return {
        "lm_loss": out.loss,
        "lr": out.lr,
        "spike_z": decision["spike_z"],
        "updated": out.updated,
        "grad_norm": out.grad_norm,
        "loss_scale": out.loss_scale,
        "nan": not math.isfinite(out.loss) or bad_gradient,
        "batch_size": global_batch,
        "part_norms": out.part_norms,
        "gradient_noise_scale": noise_scale,
        "domain_parts": out.domain_parts,
        "domain_names": names,
    }


def evaluate(run: Run, split: int) -> tuple[float, dict] | None:
    """Mean loss over --eval-iters global batches of a split (of the run's final global batch,
    as Megatron-LM evaluates during a ramp-up), and {dataset name: (loss, share)} when the split
    blends several datasets (engine.train.step.domain_losses). As in Megatron-LM, each evaluation of
    the valid split reads on from where the last one stopped (the count is in the checkpoint; a
    Parquet valid stream starts again when a run resumes); the test split is read from its
    start."""
    dataset = run.datasets[split]
    if dataset is None or run.cfg.evaluation.eval_iters == 0:
        return None
    run.optimizer.finish_param_sync()
    state, c = run.state, run.counters
    if split != 1:
        iterator = data_iterator(run, dataset, 0, num_workers=0)
    elif isinstance(dataset, StreamingDataset):
        if run.valid_iterator is None:
            run.valid_iterator = data_iterator(run, dataset, 0, num_workers=0)
        iterator = run.valid_iterator
    else:
        if c.consumed_valid_samples + run.cfg.evaluation.eval_iters * run.batches.final > len(
            dataset
        ):
            # more evaluations than the split was built for (a run resumed with other flags):
            # start it again, as Megatron-LM's cyclic loader would
            c.consumed_valid_samples = 0
        iterator = data_iterator(run, dataset, c.consumed_valid_samples, num_workers=0)
    if split == 1:
        c.consumed_valid_samples += run.cfg.evaluation.eval_iters * run.batches.final
    names = domain_names(dataset)
    total, count = None, micro_batches_per_step(run, run.batches.final)
    for _ in range(run.cfg.evaluation.eval_iters):
        batches = next_batches(iterator, count, state.device)
        values = eval_step(run.chunks, batches, state, run.schedule, len(names))
        total = values if total is None else [a + b for a, b in zip(total, values)]
    mean = [value / run.cfg.evaluation.eval_iters for value in total]
    return mean[0], domain_losses(mean[1:], names) if names else {}


def loads_batches(state) -> bool:
    """Only the first pipeline stage (tokens) and the last (labels) read token batches, as in
    Megatron-LM; a stage in between gets its input from the previous stage alone."""
    return state.is_first_stage or state.is_last_stage


def data_iterator(run: Run, dataset, consumed: int, num_workers: int, state=None):
    """This DP rank's micro-batches of a split from `consumed` samples on; None on a pipeline
    stage that reads no batches."""
    if not loads_batches(run.state):
        if isinstance(dataset, StreamingDataset):
            dataset.resume_positions(consumed, state)  # a bad data state fails on every rank
        return None
    mbs, dp_rank, dp_size = run.cfg.training.micro_batch_size, run.state.dp_rank, run.state.dp_size
    pin = run.state.device.type == "cuda"  # page-locked batches copy to the GPU asynchronously
    if isinstance(dataset, StreamingDataset):
        return dataset.iterator(consumed, mbs, dp_rank, dp_size, num_workers, state, pin)
    if isinstance(dataset, BlendedDataset) and domain_names(dataset):
        dataset = WithDomains(dataset)  # each sample says its dataset, for per-dataset losses
    return build_data_iterator(dataset, consumed, mbs, dp_rank, dp_size, num_workers, pin)


def next_batches(iterator, count: int, device: torch.device) -> list[dict]:
    """`count` micro-batches on `device` (empty ones where this stage reads none)."""
    if iterator is None:
        return [{} for _ in range(count)]
    return [to_device(next(iterator), device) for _ in range(count)]


def _announce_mix_phase(run: Run) -> None:
    """A console line when a phase of --data-mix-schedule starts with this iteration."""
    mix, iteration = run.mix, run.counters.iteration
    if mix is None or iteration == 0 or mix.phase_at(iteration).iteration != iteration:
        return
    phase = mix.phase_at(iteration)
    weights = ", ".join(f"{n} {w:.3g}" for n, w in zip(mix.names, phase.weights))
    run.writer.print(
        f"data mix from iteration {iteration} (sample {phase.first_sample}): {weights}"
    )


class NaNLimit(Exception):
    """--exit-on-nan-count reached."""


def train(run: Run) -> Counters:
    """The loop from the current counters to --train-iters (or --exit-interval)."""
    state, c = run.state, run.counters
    iterator = data_iterator(
        run, run.datasets[0], c.consumed_samples, run.cfg.data.num_workers, run.data_state
    )
    run.train_iterator = iterator
    window: list[dict] = []
    tokens_since_log = 0
    run.throughput.reset()
    run.times.take()  # the time breakdown starts with the window
    while c.iteration < run.cfg.training.train_iters:
        run.profiler.before_iteration(c.iteration)
        _announce_mix_phase(run)
        global_batch = run.batches.at(c.consumed_samples)
        count = micro_batches_per_step(run, global_batch)
        with run.times.measure("batch-generator"):
            batches = next_batches(iterator, count, state.device)
        record = train_iteration(run, batches, global_batch)
        c.iteration += 1
        run.profiler.after_iteration(c.iteration)
        c.consumed_samples += global_batch
        tokens_since_log += global_batch * run.cfg.model.seq_length
        c.skipped_iters += not record["updated"]
        c.optimizer_step += record["updated"]
        c.nan_iters += record["nan"]
        if record["spike_z"] is not None:
            action = "update skipped" if run.cfg.exit.skip_spike_batches else "kept"
            run.writer.print(
                f"loss spike at iteration {c.iteration}: {record['lm_loss']:.4f} "
                f"(z = {record['spike_z']:.1f}); {action}"
            )
        window.append(record)
        if (
            c.iteration % run.cfg.logging.log_interval == 0
            or c.iteration == run.cfg.training.train_iters
        ):
            log_window(run, window, tokens_since_log)
            window, tokens_since_log = [], 0
        every = run.cfg.evaluation.eval_interval
        if every and c.iteration % every == 0 and c.iteration < run.cfg.training.train_iters:
            with run.times.measure("evaluate"), run.times.paused():
                log_eval(run, "valid", evaluate(run, 1))
                if run.eval_prompts is not None:
                    log_samples(run)
        if run.cfg.exit.exit_on_nan_count and c.nan_iters >= run.cfg.exit.exit_on_nan_count:
            raise NaNLimit(
                f"stopping at iteration {c.iteration}: {c.nan_iters} iterations with a NaN/Inf "
                f"loss or gradient (--exit-on-nan-count {run.cfg.exit.exit_on_nan_count}); "
                "checkpoints already saved are kept"
            )
        stop = bool(run.cfg.exit.exit_interval) and c.iteration % run.cfg.exit.exit_interval == 0
        if run.checkpointer is not None and (
            stop
            or (
                run.cfg.checkpointing.save_interval
                and c.iteration % run.cfg.checkpointing.save_interval == 0
            )
        ):
            with run.times.measure("save-checkpoint"):
                save(run)
        if stop:
            run.writer.print(f"exiting at iteration {c.iteration} (--exit-interval)")
            break
        with run.times.measure("exit-check"):
            reason = run.exit_conditions.check(run.state.world_group, run.state.device)
        if reason:
            if run.checkpointer is not None and run.last_saved != c.iteration:
                save(run)
            run.writer.print(f"exiting at iteration {c.iteration}: {reason}")
            break
    return c


def finish(run: Run) -> None:
    """End of run: valid and test evaluation, a final checkpoint, peak memory per rank."""
    c = run.counters
    if c.iteration >= run.cfg.training.train_iters:
        log_eval(run, "valid", evaluate(run, 1))
        if run.eval_prompts is not None:
            log_samples(run)
        log_eval(run, "test", evaluate(run, 2))
        if run.checkpointer is not None and run.last_saved != c.iteration:
            save(run)
    if run.checkpointer is not None:
        run.checkpointer.wait()
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
