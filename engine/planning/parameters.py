"""The model's parameter count, printed at a run's start: total, embedding and, for a mixture of
experts, active per token (the routed experts a token goes to, of all of them). Counted from
the configuration (engine/planning/memory.py's per-rank count on a layout of one rank), with the
vocabulary padded as for the run's tensor-parallel size."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.model import ModelConfig
from engine.planning.memory import Layout, rank_parameter_groups


@dataclass(frozen=True)
class ParameterCount:
    total: int
    embedding: int  # the input embedding (and learned positions); an untied output layer apart
    active: int  # per token: the routed experts counted at top-k of all (= total when dense)

    def describe(self) -> str:
        line = f"parameters: {_short(self.total)} (embedding {_short(self.embedding)})"
        if self.active != self.total:
            line += f", active per token {_short(self.active)}"
        return line


def _short(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def parameter_count(cfg: ModelConfig, tp: int = 1) -> ParameterCount:
    """The whole model's parameters (all stages, all tensor-parallel shares)."""
    dense, experts = rank_parameter_groups(cfg, Layout(), 0)
    padding = (cfg.padded_vocab_size(tp) - cfg.padded_vocab_size(1)) * cfg.hidden_size
    copies = 2 if cfg.untie_embeddings_and_output_weights else 1
    total = dense + experts + padding * copies
    embedding = cfg.padded_vocab_size(tp) * cfg.hidden_size
    if cfg.position_embedding_type == "learned_absolute":
        embedding += cfg.max_positions * cfg.hidden_size
    active = total
    if experts:
        active = total - experts + experts * cfg.moe_router_topk // cfg.num_experts
    return ParameterCount(total, embedding, active)
