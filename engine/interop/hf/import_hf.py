"""A Hugging Face folder (Llama or GPT-2 safetensors) -> our checkpoint, to continue training.

The result is iteration 0 with a fresh optimizer, like Megatron-LM's --finetune: model tensors,
config and layout in meta.json, no optimizer state. Tensors are stored whole (one box each),
which every TP / PP / DP layout can load; the requested layout is checked to be valid for the
model and recorded. Each tensor is read from the safetensors files only when the checkpoint
writer reaches it, so peak memory stays near the largest tensor. Nothing is written until
every tensor's shape has been checked against config.json; the output folder is written under
a temporary name and renamed into place at the end, and an existing one is never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from engine.checkpoint.convert import check_new_output, write_converted
from engine.checkpoint.files import iteration_dir
from engine.config.tokenizer import TokenizerConfig, tokenizer_record
from engine.data.tokenizers import build_tokenizer
from engine.errors import InputError, UserError
from engine.interop.hf.architectures import hf_tensors, model_config_from_hf
from engine.interop.hf.deepseek_v3 import DEEPSEEK_V3, with_mtp_layers
from engine.interop.hf.fp8 import QUANT_METHOD as FP8
from engine.interop.hf.fp8 import SCALE as FP8_SCALE
from engine.interop.hf.fp8 import block_size as fp8_block_size
from engine.interop.hf.fp8 import dequantize as fp8_dequantize
from engine.interop.hf.hf_tensor import packed_shape, unpack
from engine.interop.hf.mxfp4 import BLOCKS, SCALES, dequantize, dequantized_shape
from parallel.checkpoint.dcp import LazyTensor
from parallel.errors import one_line
from parallel.pipeline.layout import stage_layers

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _safe_open(path: str):
    """safetensors' reader of `path`, or InputError naming the file."""
    from safetensors import safe_open

    try:
        return safe_open(path, "pt")
    except Exception as err:  # noqa: BLE001 - OSError, SafetensorError: a bad or missing file
        raise InputError(f"{path}: not a readable safetensors file ({one_line(err)})") from None


def _weight_map(folder: str, index: str) -> dict[str, str]:
    """Tensor name -> shard path from model.safetensors.index.json; shards must be files of
    the folder itself."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{index}: not a safetensors index ({one_line(err)})") from None
    if not isinstance(weight_map, dict):
        raise InputError(f"{index}: weight_map is not a table of tensor names to files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard[:1] in ("", "."):
            raise InputError(f"{index}: tensor {name} names {shard!r}, not a file of {folder}")
    return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}


class _SafetensorsFolder:
    """Lazy access to the tensors of a folder of safetensors files (one cached at a time,
    since fused HF tensors such as GPT-2's c_attn feed several of ours in a row)."""

    def __init__(self, folder: str, quantization: dict | None = None):
        """quantization: config.json's quantization_config (block-scaled FP8 weights)."""
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            self.where = _weight_map(folder, index)
        elif os.path.isfile(single):
            with _safe_open(single) as f:
                self.where = dict.fromkeys(f.keys(), single)  # noqa: SIM118 - not a dict
        else:
            raise InputError(
                f"{folder}: no model.safetensors or model.safetensors.index.json (only "
                "safetensors are read)"
            )
        # MXFP4 tensors (gpt-oss's experts): the weight `name` from name_blocks, name_scales
        self.mxfp4 = {
            name.removesuffix(BLOCKS): name
            for name in self.where
            if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in self.where
        }
        self.where |= {base: self.where[blocks] for base, blocks in self.mxfp4.items()}
        # block-scaled FP8 weights (engine/interop/hf/fp8.py): name beside name_scale_inv
        self.fp8, self.block = {}, None
        if (quantization or {}).get("quant_method") == FP8:
            try:
                self.block = fp8_block_size(quantization)
            except ValueError as err:
                raise InputError(f"{folder}/config.json: quantization_config: {err}") from None
            self.fp8 = {name for name in self.where if name + FP8_SCALE in self.where}
        self._cached: tuple[str, torch.Tensor] | None = None

    def _raw(self, name: str) -> torch.Tensor:
        with _safe_open(self.where[name]) as f:
            try:
                return f.get_tensor(name)
            except Exception as err:  # noqa: BLE001 - truncated or damaged data
                raise InputError(
                    f"{self.where[name]}: tensor {name} cannot be read ({one_line(err)})"
                ) from None

    def shape_and_dtype(self, name: str):
        if name in self.mxfp4:
            with _safe_open(self.where[name]) as f:
                blocks = tuple(f.get_slice(self.mxfp4[name]).get_shape())
            return dequantized_shape(blocks), torch.bfloat16
        if name in self.fp8:
            with _safe_open(self.where[name]) as f:
                return tuple(f.get_slice(name).get_shape()), torch.bfloat16
        with _safe_open(self.where[name]) as f:
            try:
                part = f.get_slice(name)
            except Exception as err:  # noqa: BLE001 - the index names a tensor the file lacks
                raise InputError(
                    f"{self.where[name]}: no tensor {name} ({one_line(err)})"
                ) from None
            dtype = _DTYPES.get(part.get_dtype())
            if dtype is None:
                raise InputError(
                    f"{self.where[name]}: tensor {name} is {part.get_dtype()}; only F32, BF16 "
                    "and F16 weights are imported"
                )
            return tuple(part.get_shape()), dtype

    def get(self, name: str) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            if name in self.mxfp4:
                blocks, scales = self._raw(name + BLOCKS), self._raw(name + SCALES)
                try:
                    self._cached = (name, dequantize(blocks, scales))
                except ValueError as err:
                    raise InputError(f"{self.where[name]}: tensor {name}: {err}") from None
            elif name in self.fp8:
                weight, scales = self._raw(name), self._raw(name + FP8_SCALE)
                try:
                    self._cached = (name, fp8_dequantize(weight, scales, self.block))
                except ValueError as err:
                    raise InputError(f"{self.where[name]}: tensor {name}: {err}") from None
            else:
                self._cached = (name, self._raw(name))
        return self._cached[1]


def meta_model(cfg):
    """The model `cfg` describes, built on the meta device (no memory, no initialisation)."""
    from engine.model import BuildContext, GPTModel

    with torch.device("meta"):
        return GPTModel(cfg, BuildContext(cfg, device="meta"))


def expected_shapes(model) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> logical shape of every tensor of `model` (a meta_model)."""
    from engine.checkpoint.state import model_state

    class _Chunk:
        module = model

    return {k: tuple(v.global_shape) for k, v in model_state([_Chunk()], False).items()}


def frozen_parameters(model) -> set[str]:
    """Names of the parameters of `model` no optimizer updates (the router's expert bias,
    which its own rule updates)."""
    return {
        getattr(param, "checkpoint_name", name)
        for name, param in model.named_parameters()
        if not param.requires_grad
    }


def _plan(folder: str, files: _SafetensorsFolder, cfg, style: str) -> dict:
    """Checkpoint key -> LazyTensor for every tensor of the model, each HF tensor's shape and
    dtype checked against config.json before anything is written."""
    expected = expected_shapes(meta_model(cfg))
    state = {}
    for tensor in hf_tensors(cfg, style):
        name = tensor.name
        if tensor.copy:
            continue
        if name not in files.where:
            raise InputError(f"{folder}: tensor {name} is missing from the safetensors files")
        shape, dtype = files.shape_and_dtype(name)
        full = shape[::-1] if tensor.transpose else shape
        parts = [f"model/{part}" for part in tensor.parts]
        wanted = [expected[key] for key in parts]
        if tensor.layout is not None:  # experts packed in one tensor (GptOss)
            state |= _packed_parts(folder, files, tensor, parts, wanted, shape, dtype)
            continue
        stacked = (sum(w[0] for w in wanted),) + wanted[0][1:]
        if tuple(full) != stacked:
            hf_shape = stacked[::-1] if tensor.transpose else stacked
            raise InputError(
                f"{folder}: tensor {name} has shape {list(shape)}, but config.json describes "
                f"{list(hf_shape)}; the weights do not belong to this config"
            )
        offset = 0
        for key, shape_of_part in zip(parts, wanted, strict=False):
            rows = shape_of_part[0]

            def load(name=name, start=offset, rows=rows, tensor=tensor):
                value = files.get(name)
                value = value.t() if tensor.transpose else value
                if tensor.shift:
                    value = (value.float() - tensor.shift).to(value.dtype)
                return value[start : start + rows].contiguous()

            state[key] = LazyTensor(torch.Size(shape_of_part), dtype, load)
            offset += rows
    return state


def _packed_parts(folder, files, tensor, parts, wanted, shape, dtype) -> dict:
    """The LazyTensors of our parts of an HF tensor of packed experts (hf_tensor.pack)."""
    expected = packed_shape(tensor.layout, wanted)
    if tuple(shape) != tuple(expected):
        raise InputError(
            f"{folder}: tensor {tensor.name} has shape {list(shape)}, but config.json "
            f"describes {list(expected)}; the weights do not belong to this config"
        )
    out = {}
    for index, (key, shape_of_part) in enumerate(zip(parts, wanted, strict=True)):

        def load(name=tensor.name, layout=tensor.layout, index=index):
            return unpack(layout, files.get(name))[index].contiguous()

        out[key] = LazyTensor(torch.Size(shape_of_part), dtype, load)
    return out


def import_from_hf(folder: str, output: str, tp: int = 1, pp: int = 1) -> dict:
    """Write the checkpoint folder `output` (iteration 0 + latest file) from the HF folder;
    returns a summary. `output` must not exist yet (or be an empty folder): it is written
    under a temporary name and renamed into place once complete."""
    output = check_new_output(output)
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{config_path}: no such file; --from-hf takes a model folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{config_path}: not valid JSON ({err})") from None
    try:
        cfg, style = model_config_from_hf(hf)
    except (KeyError, TypeError, AttributeError) as err:
        raise InputError(
            f"{config_path}: a field is missing or malformed ({one_line(err)})"
        ) from None
    files = _SafetensorsFolder(folder, hf.get("quantization_config"))
    if style == DEEPSEEK_V3:
        cfg = with_mtp_layers(cfg, hf, files.where)
    cfg.validate(tp)
    for rank in range(pp):
        stage_layers(cfg.num_layers, pp, rank)
    state = _plan(folder, files, cfg, style)
    tokenizer = {}

    def copy_tokenizer(staging: str) -> None:
        tokenizer["record"] = _copy_tokenizer(folder, staging, output)

    def meta(files: dict) -> dict:
        return _meta(cfg, style, state, tp, pp, tokenizer["record"], folder, files)

    write_converted(output, 0, state, meta, copy_tokenizer)
    return {
        "architecture": style,
        "tensors": len(state),
        "checkpoint": iteration_dir(output, 0),
        "model": dataclasses.asdict(cfg),
    }


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def _copy_tokenizer(folder: str, staging: str, output: str) -> dict | None:
    """The HF folder's tokenizer files, copied to <output>/tokenizer and loaded once to be sure
    they work; returns the record that makes a continued run (--use-checkpoint-args) and a
    later export use them. A folder with only tokenizer.model is read as transformers reads a
    Llama folder: SentencePiece with a bos before every text (Llama2Tokenizer)."""
    present = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    if not present:
        return None
    os.makedirs(os.path.join(staging, "tokenizer"))
    for name in present:
        shutil.copyfile(os.path.join(folder, name), os.path.join(staging, "tokenizer", name))

    def config(where: str) -> TokenizerConfig:
        if present == ["tokenizer.model"]:
            path = os.path.join(where, "tokenizer.model")
            return TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=path)
        return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=where)

    try:
        build_tokenizer(config(os.path.join(staging, "tokenizer")))
    except UserError as err:
        raise InputError(f"{folder}: its tokenizer cannot be loaded ({err})") from None
    return tokenizer_record(config(os.path.join(output, "tokenizer")))


def _meta(cfg, style, state, tp, pp, tokenizer, folder, files) -> dict:
    dtypes = {str(v.dtype).replace("torch.", "") for v in state.values()}
    return {
        "iteration": 0,
        "consumed_samples": 0,
        "layout": {"tp": tp, "pp": pp, "dp": 1, "virtual": 1, "distributed_optimizer": False},
        "model": dataclasses.asdict(cfg),
        "dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
        "tokenizer": tokenizer,
        "scheduler": {"num_steps": 0},
        "grad_scaler": None,
        "optimizer_step": 0,
        "counters": {"skipped_iters": 0, "nan_iters": 0},
        "spikes": {},
        "source": {"hf_folder": os.path.abspath(folder), "architecture": style},
        "files": files,
    }
