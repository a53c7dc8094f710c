"""Adam's state of megatron-core's distributed optimizer saved as `dp_reshardable` (Megatron-LM's
default for --use-distributed-optimizer) -> one tensor per parameter, in the layout the model's
own tensors have in the checkpoint.

That format stores, for every tensor- and pipeline-parallel rank (`dp_group_idx_<i>`, i =
pp_rank * TP + tp_rank), each gradient bucket's flat state (`param`, the fp32 master, and
`exp_avg`, `exp_avg_sq`) as megatron-core lays it out in memory; which parameter sits where is
not saved. It follows from megatron-core's rules, which this module restates:
- a rank's parameters, in the order its model registers them, are placed in reverse order;
- with the distributed optimizer each parameter starts at a multiple of 64 elements;
- a bucket ends where the checkpoint's `per_bucket_numel_unpadded` says (that list is saved);
- a word-embedding or output-layer weight shared across pipeline stages sits in a bucket of
  its own.
The registration order differs between TransformerEngine's layers (a norm fused into the next
linear, registered before its weight) and megatron-core's local layers; the saved
`--transformer-impl` picks one. Every tensor read is checked: its `param` state, cast to the
weights' dtype, must equal the saved weights exactly, or the read is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.config.model import ModelConfig
from engine.errors import InputError
from engine.interop.megatron.common import read_object
from engine.interop.megatron.layout import MegatronCheckpoint
from parallel.checkpoint.dcp import BoxTensor

_PREFIX = "optimizer.distributed.dp_group_idx_"
_BUCKET = re.compile(
    re.escape(_PREFIX) + r"(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.([a-z_]+)$"
)
# the alignment megatron-core gives each parameter's start inside a distributed-optimizer buffer
_PARAM_ALIGN = 64
_ATTN, _MLP = "self_attention", "mlp"


@dataclass(frozen=True)
class _Param:
    """One parameter of one megatron-core rank: the checkpoint's tensor it is part of (None
    for the tied output layer, which the checkpoint does not keep), its layer (or None), how
    tensor parallelism splits it, and its shape on the rank."""

    key: str | None
    layer: int | None
    split: str  # "rows", "columns", "swiglu" (gate and up halves, rows) or "" (replicated)
    shape: tuple[int, ...]
    shared: bool = False  # an embedding weight shared across pipeline stages


@dataclass(frozen=True)
class _Piece:
    """Where one rank's part of a tensor lies: its bucket's keys (per state kind), the offset
    and size inside that bucket, and the rank's place in the tensor."""

    bucket: str
    offset: int
    param: _Param
    tp_rank: int


def _layer_params(cfg: ModelConfig, fused_norms: bool) -> list[tuple[str, list[str], str]]:
    """A layer's parameters in registration order: (name for messages, stored key candidates,
    tensor-parallel split)."""
    norm_names = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    linear_bias = cfg.add_bias_linear
    qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias

    def norm(name: str, fused_into: str) -> list[tuple[str, list[str], str]]:
        return [
            (
                f"{name}.{p}",
                [f"decoder.layers.{fused_into}.layer_norm_{p}", f"decoder.layers.{name}.{p}"],
                "",
            )
            for p in norm_names
        ]

    def linear(name: str, split: str, bias: bool, bias_split: str) -> list:
        out = [(f"{name}.weight", [f"decoder.layers.{name}.weight"], split)]
        if bias:
            out.append((f"{name}.bias", [f"decoder.layers.{name}.bias"], bias_split))
        return out

    fc1_split = "swiglu" if cfg.swiglu else "rows"
    qk_norms = []
    if cfg.qk_layernorm:
        for which in ("q_layernorm", "k_layernorm"):
            qk_norms += [
                (f"{_ATTN}.{which}.{p}", [f"decoder.layers.{_ATTN}.{which}.{p}"], "")
                for p in norm_names
            ]
    proj = linear(f"{_ATTN}.linear_proj", "columns", linear_bias, "")
    qkv = linear(f"{_ATTN}.linear_qkv", "rows", qkv_bias, "rows")
    fc1 = linear(f"{_MLP}.linear_fc1", fc1_split, linear_bias, fc1_split)
    fc2 = linear(f"{_MLP}.linear_fc2", "columns", linear_bias, "")
    input_norm = norm("input_layernorm", f"{_ATTN}.linear_qkv")
    mlp_norm = norm("pre_mlp_layernorm", f"{_MLP}.linear_fc1")
    if fused_norms:  # TransformerEngine: LayerNormLinear registers its norm first
        return proj + input_norm + qkv + qk_norms + mlp_norm + fc1 + fc2
    return input_norm + proj + qkv + qk_norms + mlp_norm + fc1 + fc2


class DistributedOptimizerBuckets:
    """Reads Adam's state, per parameter, from a dp_reshardable checkpoint (see module doc)."""

    def __init__(self, source: MegatronCheckpoint, cfg: ModelConfig, args):
        self.source, self.cfg, self.path = source, cfg, source.path
        get = vars(args).get if args is not None else {}.get
        self.tp = int(get("tensor_model_parallel_size") or 1)
        self.pp = int(get("pipeline_model_parallel_size") or 1)
        uneven = [
            name
            for name in (
                "virtual_pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage",
                "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers",
                "pipeline_model_parallel_layout",
                "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split",
            )
            if get(name)
        ]
        if uneven:
            self._refuse(
                f"was saved with --{uneven[0].replace('_', '-')}; reading its layout is "
                "available for even pipeline stages without virtual stages only"
            )
        self.fused_norms = (get("transformer_impl") or "transformer_engine") != "local"
        self.buckets = self._bucket_keys()
        self.pieces: dict[tuple[str, int | None], list[_Piece]] = {}
        for tp_rank in range(self.tp):
            for pp_rank in range(self.pp):
                self._lay_out(tp_rank, pp_rank)
        self.checked: set[tuple[str, int | None]] = set()
        self.last: tuple[tuple, torch.Tensor] | None = None  # q, k, v read one fused tensor

    def _refuse(self, problem: str) -> None:
        raise InputError(
            f"{self.path}: its distributed-optimizer state (dp_reshardable) {problem}; load "
            "it with --no-load-optim (weights, iteration and samples only)"
        )

    def _bucket_keys(self) -> dict[tuple[int, int, int], str]:
        """(dp_group_idx, gbuf_idx, bucket_idx) -> the bucket's key without the state kind."""
        out = {}
        for key in self.source.stored:
            found = _BUCKET.match(key)
            if found:
                domain, gbuf, _dtype, bucket, _kind = found.groups()
                out[(int(domain), int(gbuf), int(bucket))] = key.rsplit(".", 1)[0]
        domains = {d for d, _, _ in out}
        if domains != set(range(self.tp * self.pp)):
            self._refuse(
                f"has buckets for {len(domains)} model-parallel ranks, but its arguments say "
                f"TP {self.tp} x PP {self.pp}"
            )
        return out

    def _rank_params(self, tp_rank: int, pp_rank: int) -> list[_Param]:
        """The parameters of one megatron-core rank, in the order its model registers them."""
        cfg, stored, tp = self.cfg, self.source.stored, self.tp
        first, last = pp_rank == 0, pp_rank == self.pp - 1
        per_stage = cfg.num_layers // self.pp

        def param(keys: list[str], layer: int | None, split: str, shared=False) -> _Param:
            key = next((k for k in keys if k in stored), None)
            if key is None:
                self._refuse(f"belongs to a model without {keys[0]}")
            shape = list(stored[key].size)[1 if layer is not None else 0 :]
            if split in ("rows", "swiglu"):
                shape[0] //= tp
            elif split == "columns":
                shape[-1] //= tp
            return _Param(key, layer, split, tuple(shape), shared)

        tied_across_stages = not cfg.untie_embeddings_and_output_weights and self.pp > 1
        out = []
        if first:
            embedding = "embedding.word_embeddings.weight"
            out.append(param([embedding], None, "rows", shared=tied_across_stages))
            if cfg.position_embedding_type == "learned_absolute":
                out.append(param(["embedding.position_embeddings.weight"], None, ""))
        layer_params = _layer_params(cfg, self.fused_norms)
        for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
            out += [param(keys, layer, split) for _, keys, split in layer_params]
        if last:
            norms = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
            out += [param([f"decoder.final_layernorm.{p}"], None, "") for p in norms]
            if cfg.untie_embeddings_and_output_weights:
                out.append(param(["output_layer.weight"], None, "rows"))
            elif tied_across_stages:  # a copy of the word embeddings, not in the checkpoint
                copy = param(["embedding.word_embeddings.weight"], None, "rows")
                out.append(_Param(None, None, "rows", copy.shape, shared=True))
        return out

    def _lay_out(self, tp_rank: int, pp_rank: int) -> None:
        """Place one rank's parameters in its buckets as megatron-core does (module doc)."""
        domain = pp_rank * self.tp + tp_rank
        sizes = read_object(
            self.path, f"{_PREFIX}{domain}.per_bucket_numel_unpadded", self.source.metadata
        )
        if not isinstance(sizes, list) or len(sizes) != 1 or not isinstance(sizes[0], dict):
            self._refuse(
                f"holds {len(sizes) if isinstance(sizes, list) else 'no'} gradient buffers "
                f"for rank {domain} where one (one model chunk, one dtype) is read here"
            )
        [targets] = list(sizes[0].values())
        found: list[int] = []  # the unpadded bucket sizes this placement gives
        placed: list[tuple[int, int, _Param]] = []  # (bucket, offset, param)
        start, count = 0, 0  # next free offset in the open bucket, parameters in it

        def close(size: int) -> None:
            nonlocal start, count
            found.append(size)
            start, count = 0, 0

        for param in reversed(self._rank_params(tp_rank, pp_rank)):
            if count and len(found) < len(targets) and targets[len(found)] == start:
                close(start)  # megatron-core closed the bucket after the previous parameter
            aligned = -(-start // _PARAM_ALIGN) * _PARAM_ALIGN
            if count and param.shared:
                close(aligned)  # a shared embedding weight starts a bucket of its own
                aligned = 0
            placed.append((len(found), aligned, param))
            start, count = aligned + int(torch.Size(param.shape).numel()), count + 1
            if param.shared:
                close(start)
        if count:
            close(start)
        if found != list(targets):
            self._refuse(
                f"does not line up with megatron-core's buffer layout for rank {domain} "
                f"(bucket sizes {list(targets)}, the model gives {found})"
            )
        for bucket, offset, param in placed:
            if param.key is None:
                continue
            if (domain, 0, bucket) not in self.buckets:
                self._refuse(f"has no bucket {bucket} for rank {domain}")
            piece = _Piece(self.buckets[(domain, 0, bucket)], offset, param, tp_rank)
            self.pieces.setdefault((param.key, param.layer), []).append(piece)

    def read(self, kind: str, key: str, layer: int | None) -> torch.Tensor:
        """State `kind` (param, exp_avg, exp_avg_sq) of the checkpoint's tensor `key` (one
        layer of it), in that tensor's stored layout; its `param` state is checked against
        the saved weights the first time."""
        if self.last is not None and self.last[0] == (kind, key, layer):
            return self.last[1]
        if (key, layer) not in self.checked:
            weights = self.source.read(key, layer)
            if not torch.equal(self._assemble("param", key, layer).to(weights.dtype), weights):
                self._refuse(
                    f"does not match the saved weights of {key}"
                    + (f" (layer {layer})" if layer is not None else "")
                    + "; its buffers are not laid out as megatron-core's "
                    + ("TransformerEngine" if self.fused_norms else "local")
                    + " layers place them"
                )
            self.checked.add((key, layer))
        value = self._assemble(kind, key, layer)
        self.last = ((kind, key, layer), value)
        return value

    def _assemble(self, kind: str, key: str, layer: int | None) -> torch.Tensor:
        from engine.checkpoint.load import read_tensors

        pieces = self.pieces.get((key, layer))
        if not pieces:
            self._refuse(f"holds nothing for {key}")
        # a tensor every tensor-parallel rank holds whole is read from the first
        pieces = [p for p in pieces if p.param.split or p.tp_rank == 0]
        parts, boxes = [], {}
        for piece in pieces:
            name = f"{piece.bucket}.{kind}"
            if name not in self.source.stored:
                self._refuse(f"has no {kind} (only Adam's state is read)")
            entry = self.source.stored[name]
            numel = int(torch.Size(piece.param.shape).numel())
            values = torch.empty(numel, dtype=entry.properties.dtype)
            parts.append((piece, values))
            boxes.setdefault(name, BoxTensor(torch.Size(entry.size), values.dtype, []))
            boxes[name].boxes.append(((piece.offset,), values))
        read_tensors(self.path, boxes, reader=self.source.reader, local=True)
        whole = tuple(self.source.stored[key].size)[1 if layer is not None else 0 :]
        out = torch.empty(whole, dtype=torch.float32)
        for piece, values in parts:
            _place(out, values.float().view(piece.param.shape), piece)
        return out

    def step(self) -> int:
        """Adam's step, from the first rank's saved parameter groups."""
        saved = read_object(self.path, f"{_PREFIX}0.optimizer", self.source.metadata) or {}
        groups = (saved.get("optimizer", saved) if isinstance(saved, dict) else {}).get(
            "param_groups"
        )
        steps = [g.get("step") for g in groups or [] if isinstance(g, dict) and g.get("step")]
        return int(steps[0]) if steps else 0


def _place(out: torch.Tensor, local: torch.Tensor, piece: _Piece) -> None:
    """Write one rank's part of a tensor into the whole (replicated parts: rank 0's)."""
    split, rank = piece.param.split, piece.tp_rank
    if split == "":
        if rank == 0:
            out.copy_(local)
    elif split == "rows":
        n = local.shape[0]
        out[rank * n : (rank + 1) * n] = local
    elif split == "columns":
        n = local.shape[-1]
        out[..., rank * n : (rank + 1) * n] = local
    else:  # SwiGLU's fc1: the rank holds its share of gate, then its share of up
        half, whole = local.shape[0] // 2, out.shape[0] // 2
        out[rank * half : (rank + 1) * half] = local[:half]
        out[whole + rank * half : whole + (rank + 1) * half] = local[half:]
