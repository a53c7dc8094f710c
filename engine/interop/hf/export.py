"""Our checkpoint (any TP / PP / DP layout) -> a Hugging Face folder that transformers loads.

Tensors are read from the checkpoint one at a time (DCP assembles each logical tensor from
whatever boxes the ranks wrote) and written into safetensors shards of at most
--max-shard-size, so peak memory stays near one shard. The folder is written under a temporary
name and renamed into place when complete. Only JSON and safetensors are read and written.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import torch

from engine.checkpoint.files import find_latest, iteration_dir
from engine.checkpoint.load import master_key, open_checkpoint, read_tensors, verify_checkpoint
from engine.config.model import ModelConfig
from engine.config.tokenizer import TokenizerConfig, config_from_record
from engine.data.tokenizers import Tokenizer, build_tokenizer
from engine.errors import CheckpointError, ConfigError, UserError
from engine.files.outputs import replace_folder
from engine.interop.hf.architectures import QWEN2, hf_config_dict, hf_tensors, style_of
from engine.interop.hf.hf_tensor import pack, packed_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str) -> int:
    """'2GB' / '500MB' / '1048576' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    value = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if value.endswith(unit):
            return int(float(value[: -len(unit)]) * factor)
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--max-shard-size {text!r}: use a size like 2GB or 500MB") from None


def read_tensor(path: str, key: str, shape, dtype: torch.dtype, reader=None) -> torch.Tensor:
    """One logical tensor of a checkpoint, assembled from the stored boxes."""
    out = {key: torch.empty(tuple(shape), dtype=dtype)}
    read_tensors(path, out, reader=reader)
    return out[key]


def read_weight(path: str, key: str, stored, meta: dict, reader) -> torch.Tensor:
    """The model/ tensor `key` of the checkpoint at `path`, in its dtype: its optimizer's fp32
    master, rounded to it, where the run gathered its weights in FP8 (--fp8-param-gather: its
    model/ weights hold the FP8 values the forward used, its masters what the optimizer
    trained); the tensor itself otherwise."""
    entry, source = stored[key], master_key(key)
    if not (meta.get("fp8_param_gather") and source in stored):
        return read_tensor(path, key, entry.size, entry.properties.dtype, reader)
    master = read_tensor(path, source, entry.size, stored[source].properties.dtype, reader)
    return master.to(entry.properties.dtype)


def checkpoint_path(load: str, iteration: int | None) -> str:
    if iteration is None:
        iteration = find_latest(load)
        if iteration is None:
            raise CheckpointError(
                f"{load}: not a checkpoint folder (no latest_checkpointed_iteration.txt and no "
                "iter_* folders); give the --save folder of a training run"
            )
    path = iteration_dir(load, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    return path


def _tokenizer(meta: dict, override: TokenizerConfig | None) -> Tokenizer | None:
    """The tokenizer to ship: the flags' if given, else the one training recorded."""
    cfg = override or config_from_record(meta)
    if cfg is None:
        return None
    try:
        return build_tokenizer(cfg)
    except UserError as err:
        if override is not None:
            raise
        raise ConfigError(
            f"the checkpoint's tokenizer cannot be loaded ({err}); name it with the tokenizer "
            "flags (--tokenizer-type, --tokenizer-model, ...)"
        ) from None


def export_to_hf(
    load: str,
    output: str,
    iteration: int | None = None,
    max_shard_size: str = "5GB",
    dtype: str | None = None,
    tokenizer: TokenizerConfig | None = None,
    verify: bool = True,
) -> dict:
    """Write the HF folder; returns a summary (architecture, tensors, shards, bytes). The
    checkpoint's files are checked first (checksums too unless `verify` is False)."""
    from safetensors.torch import save_file

    path = checkpoint_path(load, iteration)
    meta = verify_checkpoint(path, digests=verify)
    cfg = ModelConfig.from_record(meta["model"])
    style = style_of(cfg)
    dtype = dtype or meta.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    tokenizer = _tokenizer(meta, tokenizer)
    reader = open_checkpoint(path)
    stored = reader.read_metadata().state_dict_metadata
    plan = []
    for tensor in hf_tensors(cfg, style):
        keys = [f"model/{part}" for part in tensor.parts]
        missing = [k for k in keys if k not in stored]
        if missing:
            raise CheckpointError(f"{path}: tensor {missing[0][len('model/') :]} is missing")
        rows = sum(stored[k].size[0] for k in keys)
        shape = (rows,) + tuple(stored[keys[0]].size[1:])
        if tensor.layout is not None:
            shape = packed_shape(tensor.layout, [tuple(stored[k].size) for k in keys])
        if tensor.transpose:
            shape = shape[::-1]
        plan.append((tensor, keys, shape))
    limit = parse_size(max_shard_size)
    element = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    shards: list[list] = [[]]
    used = 0
    for item in plan:
        size = element * torch.Size(item[2]).numel()
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += size

    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    file_mode = _new_file_mode(tmp)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for tensor, keys, _ in shard:
            parts = [read_weight(path, k, stored, meta, reader) for k in keys]
            if tensor.layout is not None:  # experts packed in one tensor (GptOss)
                value = pack(tensor.layout, parts)
            else:
                value = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            value = value.t() if tensor.transpose else value
            if tensor.shift:
                value = value.float() + tensor.shift
            tensors[tensor.name] = value.to(DTYPES[dtype]).contiguous()
            weight_map[tensor.name] = name
            total += tensors[tensor.name].numel() * element
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, name), file_mode)  # safetensors writes 0600
        del tensors
    if len(shards) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    ids = tokenizer.special_ids() if tokenizer else {}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, style, ids, dtype), f, indent=1)
    generation = {
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("pad"),
    }
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=1)
    if tokenizer:
        tokenizer.save_hf(tmp)
    replace_folder(tmp, output)
    note = None
    if tokenizer and style == QWEN2:
        note = (
            "transformers' AutoTokenizer loads any qwen2 model's tokenizer as Qwen2Tokenizer, "
            "whatever tokenizer_config.json names: unless this is Qwen2's own tokenizer, load "
            "it with the class tokenizer_config.json names (e.g. LlamaTokenizer.from_pretrained)"
        )
    return {
        "note": note,
        "architecture": style,
        "tensors": len(plan),
        "shards": len(shards),
        "bytes": total,
        "checkpoint": path,
    }


def _new_file_mode(folder: str) -> int:
    """The permission bits a file newly created in folder gets (0o666 less the umask: 0644
    under umask 022), found by creating one, so the umask is never changed, not even briefly."""
    probe = os.path.join(folder, ".mode-probe")
    with open(probe, "w"):
        pass
    mode = stat.S_IMODE(os.stat(probe).st_mode)
    os.remove(probe)
    return mode
