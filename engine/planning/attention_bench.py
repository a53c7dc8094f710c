"""tools/bench_attention.py's measurements: the time of a training step's forward and backward
of a small Llama-style model on samples of packed documents, attending causally over the whole
sample or within documents (--reset-attention-mask, with --reset-position-ids), in one process
or with the sequence over context-parallel gloo ranks (ring attention)."""

from __future__ import annotations

import statistics
import time

import torch

from engine.config.model import ModelConfig
from engine.data.documents import Packing
from engine.model import BuildContext, GPTModel
from engine.planning.attention_work import EOD

VOCAB = 512


def attention_model_config(seq: int, layers: int = 2, hidden: int = 256) -> ModelConfig:
    """Attention-heavy at long sequences: few layers, head dimension 64."""
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=hidden // 64,
        seq_length=seq,
        max_position_embeddings=seq,
        vocab_size=VOCAB,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def training_batch(layout: torch.Tensor, documents: bool, seed: int = 0) -> dict:
    """A micro-batch with `layout`'s EOD places (engine/planning/attention_work.py's tokens)
    and random other tokens; with `documents`, its positions and document ids."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, layout.shape, generator=gen)
    tokens[layout == EOD] = EOD
    labels = torch.randint(1, VOCAB, layout.shape, generator=gen)
    batch = {"tokens": tokens, "labels": labels}
    if documents:
        batch = Packing(EOD, reset_position_ids=True, reset_attention_mask=True).annotate(batch)
    return batch


def time_steps(model: torch.nn.Module, batch: dict, steps: int) -> float:
    """Median seconds of a forward and backward over `batch` (after one untimed)."""
    times = []
    for k in range(steps + 1):
        start = time.perf_counter()
        loss = model(
            batch["tokens"],
            batch["labels"],
            position_ids=batch.get("position_ids"),
            document_ids=batch.get("document_ids"),
        ).mean()
        loss.backward()
        if k:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def one_process(cfg: ModelConfig, layout: torch.Tensor, documents: bool, steps: int) -> float:
    model = GPTModel(cfg, BuildContext(cfg, seed=1))
    return time_steps(model, training_batch(layout, documents), steps)


def context_parallel(
    rank: int, world: int, cfg: ModelConfig, layout: torch.Tensor, documents: bool, steps: int
) -> float:
    """One CP rank's median step time (run on `world` gloo ranks, CP = world, ring)."""
    from parallel.context_parallel.chunks import split_sequence
    from parallel.state import ParallelState

    state = ParallelState.build(cp=world)
    ctx = BuildContext(cfg, cp_group=state.cp_group, cp_size=world, cp_rank=state.cp_rank, seed=1)
    model = GPTModel(cfg, ctx)
    batch = training_batch(layout, documents)
    mine = {
        key: value if key == "document_ids" else split_sequence(value, 1, world, state.cp_rank)
        for key, value in batch.items()
    }
    return time_steps(model, mine, steps)
