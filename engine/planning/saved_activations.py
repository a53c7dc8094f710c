"""Activation memory of one transformer layer: measured (the tensors autograd saves for
backward) and predicted (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, adjusted for what this engine's layer actually keeps).

The paper counts, per layer, sbh(34 + 5as/h) bytes with 16-bit activations and 1-byte dropout
masks, and sbh(34/t + 5as/(ht)) under tensor parallelism t with sequence parallelism (without
SP only 24 of the 34 are split: sbh(10 + 24/t + 5as/(ht))). Its 34 are: the two norms' inputs
(4), the QKV input (2), Q, K and V (6), the output projection's input (2), the MLP input (2),
the GELU input (8), the second MLP linear's input (8), and two dropout masks (2); its 5as/h is
softmax, its dropout mask and the dropped probabilities of an explicit attention.

Measured here with the GPT-2 style layer (LayerNorm, GELU, biases, hidden dropout) in bf16 and
torch's flash SDPA (no attention dropout, as modern recipes run), three things differ, and the
prediction includes them:
- flash attention keeps no [a, s, s] tensor; it keeps its fp32 log-sum-exp, 4ab s bytes, so
  5as/h becomes 4a/h;
- torch's CPU dropout keeps its mask in the activation dtype (2 bytes, where CUDA's fused
  dropout keeps 1): the two masks are 4, not 2, so 34 becomes 36;
- each LayerNorm keeps its per-token mean and 1/std (2 x 2 bytes per token, 8sb for both).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

from engine.config.model import ModelConfig
from engine.model.context import BuildContext
from engine.model.layer import TransformerLayer


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage a tensor's memory is: the storage itself, not its data pointer, which
    changes when sharded parameters are released and gathered again in place (their storage
    shrunk to nothing and refilled), so that a parameter is known as one however often."""
    return tensor.untyped_storage()._cdata


def saved_activation_bytes(
    fn: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """(fn(), bytes of the distinct storages autograd saved for backward while it ran, as
    large as they are when it returns), parameters left out. Views of one storage count once,
    as they take memory once; a storage freed before fn returned (an output-discarding
    recomputation's, parallel/discarded_outputs.py) counts nothing."""
    skip = {storage_key(p) for p in parameters}
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if storage_key(tensor) not in skip:
            seen[storage_key(tensor)] = tensor.untyped_storage()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(storage.nbytes() for storage in seen.values())


class PeakSavedBytes:
    """Within `with`: the most bytes autograd held saved for backward at once (`.peak`),
    counting each storage once while any tensor the graph saved from it is alive, parameters
    (storages in `skip`) left out. Across a whole pipeline step this is the activation memory
    a rank needs: the graphs of the micro-batches in flight."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self.skip = {storage_key(p) for p in parameters}
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors alive]
        self.held = self.peak = 0
        self.hooks = None

    def _release(self, address: int) -> None:
        entry = self.live[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.held -= entry[0]
            del self.live[address]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage, address = tensor.untyped_storage(), storage_key(tensor)
        if address in self.skip or tensor.device.type == "meta":
            return tensor
        saved = tensor.detach()  # the graph's own handle: it dies when the graph frees it
        entry = self.live.setdefault(address, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.held += entry[0]
            self.peak = max(self.peak, self.held)
        entry[1] += 1
        weakref.finalize(saved, self._release, address)
        return saved

    def __enter__(self) -> PeakSavedBytes:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """The paper's bytes per layer: explicit attention, 16-bit activations, 1-byte masks."""
    sbh = s * b * h
    attention = 5 * a * s / (h * t)
    if sp:
        return sbh * (34 / t + attention)
    return sbh * (10 + 24 / t + attention)


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """The same count for this engine's bf16 GPT-2 style layer with flash attention on CPU
    (module docstring): 36 instead of 34, 4a/h instead of 5as/h, plus the norm statistics.
    Counted by engine/planning/activations.py, which covers the other layer styles too."""
    from engine.planning.activations import layer_activation_bytes as count

    cfg = ModelConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=a,
        seq_length=s,
        max_position_embeddings=s,
        vocab_size=1,
        hidden_dropout=0.1,
        attention_dropout=0.0,
    )
    return float(count(cfg, t, sp, micro_batch_size=b))


def measure_layer(cfg: ModelConfig, tp_group, tp_size: int, sp: bool, micro_batch_size: int) -> int:
    """Bytes one bf16 transformer layer of cfg saves for backward on this rank (training mode,
    seq_length tokens per sample, [s/t, b, h] inputs under SP)."""
    ctx = BuildContext(
        cfg,
        tp_group=tp_group,
        tp_size=tp_size,
        sequence_parallel=sp and tp_size > 1,
        params_dtype=torch.bfloat16,
    )
    layer = TransformerLayer(ctx, 0).train()
    s = cfg.seq_length // tp_size if ctx.sequence_parallel else cfg.seq_length
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(s, micro_batch_size, cfg.hidden_size, generator=generator)
    x = x.to(torch.bfloat16).requires_grad_()
    rotary = None
    if cfg.uses_rope:  # the whole sequence's positions, as the model passes them
        from engine.model.rope import RotaryEmbedding

        positions = ctx.token_positions(cfg.seq_length, "cpu")
        rotary = RotaryEmbedding.for_config(cfg)(positions, cfg.seq_length)
    return saved_activation_bytes(lambda: layer(x, rotary), layer.parameters())[1]


def measure_layer_context_parallel(
    cfg: ModelConfig, state, comm_type: str, micro_batch_size: int
) -> int:
    """Bytes one bf16 Llama-style layer of cfg saves for backward on this context-parallel
    rank (its seq_length / CP tokens of each sample, RoPE at their global positions)."""
    from engine.model.rope import RotaryEmbedding

    ctx = BuildContext(
        cfg,
        cp_group=state.cp_group,
        cp_size=state.cp_size,
        cp_rank=state.cp_rank,
        cp_comm_type=(comm_type,),
        params_dtype=torch.bfloat16,
    )
    layer = TransformerLayer(ctx, 0).train()
    s = cfg.seq_length // state.cp_size
    rotary = RotaryEmbedding.for_config(cfg)(ctx.token_positions(s, "cpu"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(s, micro_batch_size, cfg.hidden_size, generator=generator)
    x = x.to(torch.bfloat16).requires_grad_()
    return saved_activation_bytes(lambda: layer(x, rotary), layer.parameters())[1]
