"""--rollback-on-spike: when the loss spikes, go back to the newest checkpoint of --save at
least --rollback-iterations before the spike and skip the data between that checkpoint and the
spike (PaLM's recovery: the batches that led into the spike are not seen again), then go on.

The run's data position does not go back: the reader is already past the spike's batches, and
the counters' consumed samples stay where they were, so the window [checkpoint + 1, spike] is
skipped exactly as --skip-data-iterations would skip it from the start. In this order, so that
a failure at any point resumes as the rollback meant: the window goes to
--save/skipped_data.json, the latest file names the checkpoint reloaded, and the checkpoints of
the abandoned stretch (newer than that one) are moved into --save/rolled_back_<spike>/.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from engine.checkpoint.files import committed_iterations, iteration_dir, point_latest, read_meta
from engine.train.checkpoint import read_into_model, restore_progress
from engine.train.data_skips import DataWindow, recorded_in, write_recorded
from engine.train.state import Run

ROLLBACK_CAUSE = "rollback at the loss spike of iteration"


def rollbacks_done(save: str) -> int:
    return sum(w.cause.startswith(ROLLBACK_CAUSE) for w in recorded_in(save))


def roll_back(run: Run, spike_iteration: int, z: float) -> bool:
    """Reload and skip as above (collective: every rank decides the same from the same loss).
    False, with a line saying why, when no rollback is possible (the limit reached, or no
    checkpoint far enough back)."""
    exits, save = run.cfg.exit, run.cfg.checkpointing.save
    if rollbacks_done(save) >= exits.rollback_max:
        run.writer.print(f"no rollback: --rollback-max {exits.rollback_max} reached")
        return False
    run.checkpointer.wait()  # a save in flight is committed (or failed) first
    _barrier(run)
    wanted = spike_iteration - exits.rollback_iterations
    older = [i for i in committed_iterations(save) if i <= wanted]
    if not older:
        run.writer.print(
            f"no rollback: no checkpoint in {save} at iteration {wanted} or before "
            f"(--rollback-iterations {exits.rollback_iterations}; save more often)"
        )
        return False
    target = older[-1]
    path = iteration_dir(save, target)
    consumed = run.progress.counters.consumed_samples  # the reader is past the spike's data
    window = DataWindow(
        target + 1, spike_iteration, f"{ROLLBACK_CAUSE} {spike_iteration} (z = {z:.1f})",
        (read_meta(path)["consumed_samples"], consumed),
    )  # fmt: skip
    # windows skipped since that checkpoint stay skipped: the data position does not go back
    applied_since = [w for w in run.progress.skipped_data if w.first > target]
    run.optimizer.finish_param_sync()  # no overlapped gather may land on the loaded weights
    _barrier(run)
    if run.state.rank == 0:  # the window first: a failure from here on resumes and skips it
        write_recorded(save, [*recorded_in(save), window])
        point_latest(save, target)
        _set_aside(save, target, spike_iteration)
    _barrier(run)
    meta = read_into_model(run, path, load_optimizer=True, load_rng=True)
    restore_progress(run, meta, path, load_optimizer=True)
    run.progress.counters.consumed_samples = consumed
    run.progress.skipped_data += [*applied_since, window]
    run.progress.last_saved = target
    run.progress.last_train_loss = None  # the abandoned stretch's
    run.writer.print(
        f"rolled back to {path} after the loss spike at iteration {spike_iteration} "
        f"(z = {z:.1f}); skipping {window.describe()}"
    )
    return True


def _set_aside(save: str, target: int, spike_iteration: int) -> None:
    """The abandoned stretch's checkpoints moved out of the way (the latest file already names
    `target`)."""
    newer = [i for i in committed_iterations(save) if i > target]
    if newer:
        aside, count = os.path.join(save, f"rolled_back_{spike_iteration}"), 1
        while os.path.exists(aside):  # a spike at the same iteration again
            count += 1
            aside = os.path.join(save, f"rolled_back_{spike_iteration}_{count}")
        os.makedirs(aside)
        for iteration in newer:
            folder = iteration_dir(save, iteration)
            os.replace(folder, os.path.join(aside, os.path.basename(folder)))


def _barrier(run: Run) -> None:
    if run.state.world_group is not None:
        dist.barrier(group=run.state.world_group)
