"""A Hugging Face folder (Llama or GPT-2 safetensors) -> our checkpoint, to continue training.

The result is iteration 0 with a fresh optimizer, like Megatron-LM's --finetune: model tensors,
config and layout in meta.json, no optimizer state. Tensors are stored whole (one box each),
which every TP / PP / DP layout can load; the requested layout is checked to be valid for the
model and recorded. Each tensor is read from the safetensors files only when the checkpoint
writer reaches it, so peak memory stays near the largest tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

import torch

from engine.checkpointing import FORMAT_VERSION, commit, iteration_dir
from engine.errors import InputError
from engine.hf.architectures import hf_tensors, model_config_from_hf
from parallel.dcp import BoxSavePlanner, LazyTensor
from parallel.pipeline.layout import stage_layers


class _SafetensorsFolder:
    """Lazy access to the tensors of a folder of safetensors files (one cached at a time,
    since fused HF tensors such as GPT-2's c_attn feed several of ours in a row)."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.where = {
                    k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()
                }
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            from safetensors import safe_open

            path = os.path.join(folder, "model.safetensors")
            with safe_open(path, "pt") as f:
                self.where = dict.fromkeys(f.keys(), path)  # noqa: SIM118 - not a dict
        else:
            raise InputError(
                f"{folder}: no model.safetensors or model.safetensors.index.json (only "
                "safetensors are read)"
            )
        self._cached: tuple[str, torch.Tensor] | None = None

    def shape_and_dtype(self, name: str):
        from safetensors import safe_open

        with safe_open(self.where[name], "pt") as f:
            part = f.get_slice(name)
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[
                part.get_dtype()
            ]
            return tuple(part.get_shape()), dtype

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if self._cached is None or self._cached[0] != name:
            with safe_open(self.where[name], "pt") as f:
                self._cached = (name, f.get_tensor(name))
        return self._cached[1]


def import_from_hf(folder: str, output: str, tp: int = 1, pp: int = 1) -> dict:
    """Write `output/iter_0000000` (+ latest file) from the HF folder; returns a summary."""
    import torch.distributed.checkpoint as dcp

    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{config_path}: no such file; --from-hf takes a model folder") from None
    cfg, style = model_config_from_hf(hf)
    cfg.validate(tp)
    for rank in range(pp):
        stage_layers(cfg.num_layers, pp, rank)
    files = _SafetensorsFolder(folder)
    state = {}
    for tensor in hf_tensors(cfg, style):
        name = tensor.name
        if name not in files.where:
            raise InputError(f"{folder}: tensor {name} is missing from the safetensors files")
        shape, dtype = files.shape_and_dtype(name)
        full = shape[::-1] if tensor.transpose else shape
        rows = full[0] // len(tensor.parts)
        if rows * len(tensor.parts) != full[0]:
            raise InputError(f"{folder}: tensor {name} of shape {list(shape)} cannot be split")
        for index, part in enumerate(tensor.parts):

            def load(name=name, index=index, rows=rows, transpose=tensor.transpose):
                value = files.get(name)
                value = value.t() if transpose else value
                return value[index * rows : (index + 1) * rows].contiguous()

            state[f"model/{part}"] = LazyTensor(torch.Size((rows,) + full[1:]), dtype, load)
    tmp = iteration_dir(output, 0) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(output, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": on purpose
        dcp.save(state, checkpoint_id=tmp, planner=BoxSavePlanner(), no_dist=True)
    tokenizer = None
    if os.path.isfile(os.path.join(folder, "tokenizer.model")):
        tokenizer = os.path.join(os.path.abspath(output), "tokenizer.model")
        shutil.copyfile(os.path.join(folder, "tokenizer.model"), tokenizer)
    dtypes = {str(v.dtype).replace("torch.", "") for v in state.values()}
    meta = {
        "format_version": FORMAT_VERSION,
        "iteration": 0,
        "consumed_samples": 0,
        "layout": {"tp": tp, "pp": pp, "dp": 1, "virtual": 1, "distributed_optimizer": False},
        "model": dataclasses.asdict(cfg),
        "dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
        "tokenizer_model": tokenizer,
        "scheduler": {"num_steps": 0},
        "grad_scaler": None,
        "optimizer_step": 0,
        "counters": {"skipped_iters": 0, "nan_iters": 0},
        "spikes": {},
        "source": {"hf_folder": os.path.abspath(folder), "architecture": style},
    }
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    commit(tmp, output, 0)
    return {
        "architecture": style,
        "tensors": len(state),
        "checkpoint": iteration_dir(output, 0),
        "model": dataclasses.asdict(cfg),
    }
