"""Averaging a run's last checkpoints into a new one (tools/average_checkpoints.py): the model
weights of the last K committed checkpoints under a --save folder, whatever layout each was
written in, averaged uniformly or with exponentially decaying weights (the newest heaviest),
and written as a checkpoint of one rank that loads (into any layout), evaluates and exports
like any other. It holds the weights only: resume training from it with --finetune (or
--no-load-optim), as from an imported Hugging Face model."""

from __future__ import annotations

import json
import os

import torch

from engine.checkpoint.convert import check_new_output, write_converted
from engine.checkpoint.files import is_iteration_name, read_meta
from engine.checkpoint.load import load_model_weights
from engine.checkpoint.state import model_state
from engine.errors import InputError


def committed(load: str) -> list[tuple[int, str]]:
    """(iteration, folder) of every complete checkpoint under `load`, oldest first."""
    if not os.path.isdir(load):
        raise InputError(f"--load {load}: no such folder; give a run's --save folder")
    found = []
    for name in os.listdir(load):
        folder = os.path.join(load, name)
        if is_iteration_name(name) and os.path.isfile(os.path.join(folder, "meta.json")):
            found.append((int(name[len("iter_") :]), folder))
    return sorted(found)


def weights_for(count: int, ema: float | None) -> list[float]:
    """Oldest first, summing to 1: uniform, or ema**(age) normalised (the newest weighs most)."""
    if ema is None:
        return [1.0 / count] * count
    raw = [ema ** (count - 1 - k) for k in range(count)]
    return [w / sum(raw) for w in raw]


class _Chunk:
    def __init__(self, module):
        self.module = module


def average_checkpoints(load: str, last: int, output: str, ema: float | None = None) -> dict:
    """Write the average of the last `last` checkpoints under `load` to `output` (a new
    folder); returns a summary. Every file of each is checked against its checksum first."""
    from engine.config.model import ModelConfig
    from engine.model import BuildContext, GPTModel

    output = check_new_output(output)
    if last < 2:
        raise InputError(f"--last {last}: give at least 2 checkpoints to average")
    if ema is not None and not 0 < ema < 1:
        raise InputError(f"--ema {ema}: give a decay between 0 and 1 (such as 0.9)")
    found = committed(load)
    if len(found) < last:
        raise InputError(
            f"--last {last}: {load} holds {len(found)} complete checkpoint(s); give at most "
            f"{len(found)}"
        )
    chosen = found[-last:]
    metas = [read_meta(folder) for _, folder in chosen]
    shapes = {json.dumps(m["model"], sort_keys=True) for m in metas}
    if len(shapes) > 1:
        raise InputError(
            f"{load}: the last {last} checkpoints are of different models; give fewer with --last"
        )
    cfg = ModelConfig.from_record(metas[-1]["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    weights = weights_for(last, ema)
    total: dict[str, torch.Tensor] = {}
    for weight, (_, folder) in zip(weights, chosen, strict=True):
        load_model_weights(folder, model)  # verified, resharded from its layout
        for name, param in model.state_dict().items():
            if torch.is_floating_point(param):
                part = param.detach().to(torch.float64) * weight
                total[name] = total[name] + part if name in total else part
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in total:
                param.copy_(total[name].to(param.dtype))
    state = model_state([_Chunk(model)], for_save=True)
    newest = metas[-1]
    iteration = chosen[-1][0]
    record = {
        "iterations": [it for it, _ in chosen],
        "weights": weights,
        "source": os.path.abspath(load),
    }

    def meta(files: dict) -> dict:
        return {
            **{k: newest[k] for k in ("model", "dtype", "tokenizer", "consumed_samples")},
            "iteration": iteration,
            "layout": {"tp": 1, "pp": 1, "dp": 1, "virtual": 1, "distributed_optimizer": False},
            "scheduler": {"num_steps": 0},
            "grad_scaler": None,
            "optimizer_step": 0,
            "counters": {"skipped_iters": 0, "nan_iters": 0},
            "spikes": {},
            "averaged": record,
            "files": files,
        }

    folder = write_converted(output, iteration, state, meta)
    return {"checkpoint": folder, **record}
