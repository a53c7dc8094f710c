"""Weights & Biases logging (--wandb-project), as Megatron-LM logs there: the same scalars as
TensorBoard under Megatron-LM's tag names, against the iteration, plus "samples vs steps".

wandb is optional: it is imported only when --wandb-project is given (the start-up checks
refuse the flag in one line when it is not importable). WANDB_MODE=offline writes the run
under the save folder without network; `wandb sync` uploads it later.
"""

from __future__ import annotations

import importlib.util
import os

from engine.monitor.metrics import tensorboard_scalars


def wandb_folder(logging, checkpointing) -> str:
    """Where the run's files go: --wandb-save-dir, else <--save>/wandb (as Megatron-LM)."""
    return logging.wandb_save_dir or os.path.join(checkpointing.save, "wandb")


def wandb_importable() -> bool:
    return importlib.util.find_spec("wandb") is not None


class WandbWriter:
    """One wandb run, written by the logging rank."""

    def __init__(self, logging, checkpointing, config: dict):
        """`logging` and `checkpointing`: engine/config's LoggingConfig and CheckpointConfig;
        `config`: the run's settings, as wandb's run config."""
        import wandb

        folder = wandb_folder(logging, checkpointing)
        os.makedirs(folder, exist_ok=True)
        options = {"dir": folder, "project": logging.wandb_project, "config": config}
        if logging.wandb_exp_name:
            options["name"] = logging.wandb_exp_name
        if logging.wandb_entity:
            options["entity"] = logging.wandb_entity
        self.run = wandb.init(**options)

    def log(self, record: dict, step: int, split: str | None = None) -> None:
        values = {
            tag: v for tag, v, axis in tensorboard_scalars(record, split) if axis == "iteration"
        }
        if split is None and "consumed_samples" in record:
            values["samples vs steps"] = record["consumed_samples"]
        if values:
            self.run.log(values, step=step)

    def log_samples(self, record: dict, step: int) -> None:
        """Generation samples (--eval-prompts) as a table: prompt, greedy, sampled."""
        import wandb

        rows = [[s["prompt"], s["greedy"], s["sampled"]] for s in record["samples"]]
        table = wandb.Table(columns=["prompt", "greedy", "sampled"], data=rows)
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
