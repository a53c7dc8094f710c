"""Adam's state of megatron-core's distributed optimizer saved as `dp_reshardable` (Megatron-LM's
default for --use-distributed-optimizer) -> one tensor per parameter, in the layout the model's
own tensors have in the checkpoint.

That format stores, for every rank of each optimizer's model-parallel domain (`dp_group_idx_<i>`:
a tensor- and pipeline-parallel rank, or with expert parallelism also an expert-parallel rank
of the experts' chained optimizer; engine/interop/megatron/bucket_params.py), each gradient
bucket's flat state (`param`, the fp32 master, and `exp_avg`, `exp_avg_sq`) as megatron-core
lays it out in memory; which parameter sits where is not saved. It follows from megatron-core's
rules, which this module restates:
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
from engine.interop.megatron.bucket_params import MegatronParam, MegatronRanks
from engine.interop.megatron.common import read_object
from engine.interop.megatron.layout import MegatronCheckpoint
from parallel.checkpoint.dcp import BoxTensor

_BUCKET = re.compile(
    r"(.*optimizer\.distributed\.)dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\."
    r"bucket_idx_(\d+)\.([a-z_]+)$"
)
# the alignment megatron-core gives each parameter's start inside a distributed-optimizer buffer
_PARAM_ALIGN = 64


@dataclass(frozen=True)
class _Piece:
    """Where one rank's part of a tensor lies: its bucket's keys (per state kind), the offset
    and size inside that bucket, and the part itself."""

    bucket: str
    offset: int
    param: MegatronParam


class DistributedOptimizerBuckets:
    """Reads Adam's state, per parameter, from a dp_reshardable checkpoint (see module doc)."""

    def __init__(self, source: MegatronCheckpoint, cfg: ModelConfig, args):
        self.source, self.cfg, self.path = source, cfg, source.path
        get = vars(args).get if args is not None else {}.get
        ranks = MegatronRanks(source, cfg, get, self._refuse)
        self.fused_norms = ranks.fused_norms
        self.buckets = self._bucket_keys()
        self.optimizers = ranks.optimizers()
        prefixes = sorted(prefix for prefix, _ in self.optimizers)
        if sorted({prefix for prefix, _, _ in self.buckets}) != prefixes:
            self._refuse(
                f"holds the buckets of {len({p for p, _, _ in self.buckets})} chained "
                f"optimizers where its arguments give {len(prefixes)} (one, and a second for "
                "the experts with --expert-model-parallel-size above 1)"
            )
        self.pieces: dict[tuple[str, tuple[int, ...]], list[_Piece]] = {}
        for prefix, domains in self.optimizers:
            found = {domain for p, domain, _ in self.buckets if p == prefix}
            if found != set(domains):
                self._refuse(
                    f"has buckets for {len(found)} model-parallel ranks in {prefix}, but its "
                    f"arguments give {len(domains)} (TP {ranks.tp} x PP {ranks.pp}"
                    + (f", experts ETP {ranks.etp} x EP {ranks.ep})" if ranks.ep > 1 else ")")
                )
            for domain, params in domains.items():
                self._lay_out(prefix, domain, params)
        self.checked: set[tuple[str, tuple[int, ...]]] = set()
        self.last: tuple[tuple, torch.Tensor] | None = None  # q, k, v read one fused tensor

    def _refuse(self, problem: str) -> None:
        raise InputError(
            f"{self.path}: its distributed-optimizer state (dp_reshardable) {problem}; load "
            "it with --no-load-optim (weights, iteration and samples only)"
        )

    def _bucket_keys(self) -> dict[tuple[str, int, int], str]:
        """(optimizer prefix, dp_group_idx, bucket_idx) -> the bucket's key without the state
        kind (one gradient buffer per rank: gbuf_idx 0)."""
        out = {}
        for key in self.source.stored:
            found = _BUCKET.match(key)
            if found:
                prefix, domain, _gbuf, _dtype, bucket, _kind = found.groups()
                out[(prefix, int(domain), int(bucket))] = key.rsplit(".", 1)[0]
        return out

    def _lay_out(self, prefix: str, domain: int, params: list[MegatronParam]) -> None:
        """Place one rank's parameters in its buckets as megatron-core does (module doc)."""
        name = f"{prefix}dp_group_idx_{domain}"
        sizes = read_object(self.path, f"{name}.per_bucket_numel_unpadded", self.source.metadata)
        if not isinstance(sizes, list) or len(sizes) != 1 or not isinstance(sizes[0], dict):
            self._refuse(
                f"holds {len(sizes) if isinstance(sizes, list) else 'no'} gradient buffers "
                f"for {name} where one (one model chunk, one dtype) is read here"
            )
        [targets] = list(sizes[0].values())
        found: list[int] = []  # the unpadded bucket sizes this placement gives
        placed: list[tuple[int, int, MegatronParam]] = []  # (bucket, offset, param)
        start, count = 0, 0  # next free offset in the open bucket, parameters in it

        def close(size: int) -> None:
            nonlocal start, count
            found.append(size)
            start, count = 0, 0

        for param in reversed(params):
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
                f"does not line up with megatron-core's buffer layout for {name} "
                f"(bucket sizes {list(targets)}, the model gives {found})"
            )
        for bucket, offset, param in placed:
            if param.key is None:
                continue
            if (prefix, domain, bucket) not in self.buckets:
                self._refuse(f"has no bucket {bucket} for {name}")
            piece = _Piece(self.buckets[(prefix, domain, bucket)], offset, param)
            self.pieces.setdefault((param.key, param.index), []).append(piece)

    def read(self, kind: str, key: str, index: tuple[int, ...]) -> torch.Tensor:
        """State `kind` (param, exp_avg, exp_avg_sq) of the checkpoint's tensor `key` (at
        `index` of its leading axes: a layer, an expert), in that tensor's stored layout; its
        `param` state is checked against the saved weights the first time."""
        index = tuple(index)
        if self.last is not None and self.last[0] == (kind, key, index):
            return self.last[1]
        if (key, index) not in self.checked:
            weights = self.source.read(key, index)
            if not torch.equal(self._assemble("param", key, index).to(weights.dtype), weights):
                self._refuse(
                    f"does not match the saved weights of {key}"
                    + (f" (at {list(index)})" if index else "")
                    + "; its buffers are not laid out as megatron-core's "
                    + ("TransformerEngine" if self.fused_norms else "local")
                    + " layers place them"
                )
            self.checked.add((key, index))
        value = self._assemble(kind, key, index)
        self.last = ((kind, key, index), value)
        return value

    def _assemble(self, kind: str, key: str, index: tuple[int, ...]) -> torch.Tensor:
        from engine.checkpoint.load import read_tensors

        pieces = self.pieces.get((key, index))
        if not pieces:
            self._refuse(f"holds nothing for {key}")
        # each part once (a tensor several ranks hold whole: from the first of them)
        pieces = list({piece.param.rank: piece for piece in reversed(pieces)}.values())
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
        whole = tuple(self.source.stored[key].size)[len(index) :]
        out = torch.empty(whole, dtype=torch.float32)
        for piece, values in parts:
            _place(out, values.float().view(piece.param.shape), piece.param)
        return out

    def step(self) -> int:
        """Adam's step, from the first rank's saved parameter groups."""
        first = f"{self.optimizers[0][0]}dp_group_idx_0.optimizer"
        saved = read_object(self.path, first, self.source.metadata) or {}
        groups = (saved.get("optimizer", saved) if isinstance(saved, dict) else {}).get(
            "param_groups"
        )
        steps = [g.get("step") for g in groups or [] if isinstance(g, dict) and g.get("step")]
        return int(steps[0]) if steps else 0


def _place(out: torch.Tensor, local: torch.Tensor, param: MegatronParam) -> None:
    """Write one rank's part of a tensor into the whole."""
    split, rank = param.split, param.rank
    if split == "":
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
