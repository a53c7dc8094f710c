"""Weights & Biases logging (--wandb-project), as Megatron-LM logs there: the same scalars as
TensorBoard under Megatron-LM's tag names, against the iteration, plus "samples vs steps".

wandb is optional: it is imported only when --wandb-project is given (the start-up checks
refuse the flag in one line when it is not importable). WANDB_MODE=offline writes the run
under the save folder without network; `wandb sync` uploads it later.
"""

from __future__ import annotations

import importlib.util
import os

from engine.errors import ConfigError
from engine.monitor.metrics import tensorboard_scalars


def wandb_folder(train) -> str:
    """Where the run's files go: --wandb-save-dir, else <--save>/wandb (as Megatron-LM)."""
    return train.wandb_save_dir or os.path.join(train.save, "wandb")


def wandb_importable() -> bool:
    return importlib.util.find_spec("wandb") is not None


def check_wandb_flags(train) -> None:
    """ConfigError (one line) when --wandb-project cannot be honoured."""
    if not train.wandb_project:
        return
    if not wandb_importable():
        raise ConfigError(
            "--wandb-project: wandb is not importable; `pip install wandb` (WANDB_MODE=offline "
            "logs without network) or drop the --wandb-* flags"
        )
    if not train.wandb_save_dir and not train.save:
        raise ConfigError(
            "--wandb-project needs a folder for the run: give --wandb-save-dir DIR or --save DIR "
            "(its wandb/ subfolder is used)"
        )


class WandbWriter:
    """One wandb run, written by the logging rank."""

    def __init__(self, train, config: dict):
        import wandb

        folder = wandb_folder(train)
        os.makedirs(folder, exist_ok=True)
        options = {"dir": folder, "project": train.wandb_project, "config": config}
        if train.wandb_exp_name:
            options["name"] = train.wandb_exp_name
        if train.wandb_entity:
            options["entity"] = train.wandb_entity
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
