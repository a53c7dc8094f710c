"""The parameter count printed at a run's start (engine/planning/parameters.py) against the
model built for real: total, embedding, and a mixture of experts' parameters active per token
(every tensor but the routed experts, and top-k of those)."""

from __future__ import annotations

import pytest

from engine.planning.parameters import parameter_count
from tests.distributed import run_ranks
from tests.test_plan import LLAMA, RUN
from tests.test_plan_moe import MOE

GPT2 = [
    "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "48", "--vocab-size", "1000",
]  # fmt: skip


def _built(rank, world, cfg):
    from engine.model.builder import build_model_chunks
    from parallel.expert_parallel.params import is_expert_parallel
    from parallel.state import ParallelState

    chunks = build_model_chunks(cfg, ParallelState.build(1, 1))
    params = {id(p): p for chunk in chunks for p in chunk.parameters()}.values()
    embedding = sum(
        p.numel() for chunk in chunks for n, p in chunk.named_parameters() if "embedding" in n
    )
    experts = sum(p.numel() for p in params if is_expert_parallel(p))
    return sum(p.numel() for p in params), embedding, experts


@pytest.mark.parametrize("flags", [GPT2, LLAMA, MOE], ids=["gpt2", "llama", "moe"])
def test_the_count_is_the_models(flags):
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    cfg = prepare(parse([*flags, *RUN, "--micro-batch-size", "1"]), 1).model
    [(total, embedding, experts)] = run_ranks(_built, 1, cfg)
    count = parameter_count(cfg)
    assert (count.total, count.embedding) == (total, embedding)
    if cfg.num_experts:
        assert experts > 0
        assert count.active == total - experts + experts * cfg.moe_router_topk // cfg.num_experts
        assert "active per token" in count.describe()
    else:
        assert count.active == total
