"""Activation memory per transformer layer under TP 1, 2, 4, with and without sequence
parallelism: the bytes autograd really saves (saved-tensor hooks) against Korthikanti et al.'s
count adjusted for this layer (engine/planning/saved_activations.py), within 5%. Under SP the
column- parallel linears keep only their input shard, so everything in the layer divides by t."""

from __future__ import annotations

from engine.planning.saved_activations import layer_activation_bytes, measure_layer
from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import tiny_config

S, B, H, A = 128, 2, 128, 4


def _measure(rank, world):
    cfg = tiny_config(
        "gpt2", num_layers=1, hidden_size=H, num_attention_heads=A, seq_length=S,
        hidden_dropout=0.1, attention_dropout=0.0,
    )  # fmt: skip
    out = {}
    for tp in (1, 2, 4):
        state = ParallelState.build(tp=tp)
        for sp in (False, True) if tp > 1 else (False,):
            out[(tp, sp)] = measure_layer(cfg, state.tp_group, tp, sp, B)
    return out


def test_layer_activation_bytes_match_the_formula_and_sp_divides_them():
    results = run_ranks(_measure, 4)
    for rank_result in results:
        for (tp, sp), measured in rank_result.items():
            expected = layer_activation_bytes(S, B, H, A, tp, sp)
            assert abs(measured - expected) / expected < 0.05, (tp, sp, measured, expected)
    base = results[0][(1, False)]
    for tp in (2, 4):
        # With SP a layer keeps 1/t of what one process keeps (norm statistics and all).
        assert abs(results[0][(tp, True)] * tp / base - 1) < 0.01, tp
