"""Evaluation of the valid and test splits during and after training."""

from __future__ import annotations

from engine.train.batches import data_iterator, domain_names, micro_batches_per_step, next_batches
from engine.train.loss import domain_losses
from engine.train.state import Run
from engine.train.step import eval_step


def evaluate(run: Run, split: int) -> tuple[float, dict] | None:
    """Mean loss over --eval-iters global batches of a split (of --eval-global-batch-size in
    micro-batches of --eval-micro-batch-size; by default the run's final global batch, as
    Megatron-LM evaluates during a ramp-up, and its micro-batch), and {dataset name: (loss,
    share)} when the split blends several datasets (engine/train/loss.py's domain_losses).
    As in Megatron-LM, each evaluation of the valid split reads on from where the last one
    stopped (the count is in the checkpoint, from which a resumed run reads on where the split
    seeks by count; a Parquet valid stream starts again); the test split is read from its
    start."""
    dataset = run.datasets[split]
    eval_iters = run.cfg.evaluation.eval_iters
    if dataset is None or eval_iters == 0:
        return None
    run.optimizer.finish_param_sync()
    state, progress = run.state, run.progress
    c = progress.counters
    final, mbs = run.cfg.evaluation.batch_sizes(
        run.batches.final, run.cfg.training.micro_batch_size
    )
    if split != 1:
        iterator = data_iterator(state, mbs, dataset, 0, 0, packing=run.packing)
    else:
        if c.consumed_valid_samples + eval_iters * final > len(dataset):
            # more evaluations than the split was built for (a run resumed with other flags):
            # start it again, as Megatron-LM's cyclic loader would
            c.consumed_valid_samples, progress.valid_iterator = 0, None
        if progress.valid_iterator is None:  # the first evaluation of this process
            start = dataset.restart_point(c.consumed_valid_samples)
            progress.valid_iterator = data_iterator(
                state, mbs, dataset, start, 0, packing=run.packing
            )
        iterator = progress.valid_iterator
        c.consumed_valid_samples += eval_iters * final
    names = domain_names(dataset)
    total, weight, count = None, 0.0, micro_batches_per_step(mbs, state, final)
    for _ in range(eval_iters):
        batches = next_batches(iterator, count, state.device, run.packing)
        values, tokens = eval_step(
            run.chunks, batches, state, run.eval_schedule, len(names), run.loss_reduction
        )
        # as Megatron-LM: over every token of the evaluation (counted where they differ)
        tokens = 1.0 if tokens is None else tokens
        values = [value * tokens for value in values]
        total = values if total is None else [a + b for a, b in zip(total, values, strict=False)]
        weight += tokens
    mean = [value / weight for value in total]
    return mean[0], domain_losses(mean[1:], names) if names else {}
