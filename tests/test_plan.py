"""The planner (engine/planning/, tools/plan.py) against the engine run for real on gloo ranks:
per-rank memory predicted for 14 layouts, every layout it proposes passes the engine's checks,
the ones it shows launch and fit; and its step-time model against Megatron-LM's published
H100 results."""

from __future__ import annotations

import json

import pytest

from engine.planning.memory import Layout
from tests.cli import one_line_error, run_tool
from tests.distributed import run_ranks

GPT2 = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1000",
    "--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0.1",
    "--attention-dropout", "0.0",
]  # fmt: skip
LLAMA = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--vocab-size", "1000",
    "--make-vocab-size-divisible-by", "128", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--hidden-dropout", "0.0",
    "--attention-dropout", "0.0",
]  # fmt: skip
RUN = [
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "10", "--lr", "1e-4",
    "--log-interval", "1000",
]  # fmt: skip

MEMORY_LAYOUTS = [
    ("gpt2", Layout(micro_batch_size=2, num_microbatches=2), "none"),
    ("gpt2", Layout(micro_batch_size=2), "full"),
    ("llama", Layout(micro_batch_size=2), "selective"),
    ("gpt2", Layout(tp=2, sequence_parallel=True, micro_batch_size=2), "none"),
    ("llama", Layout(tp=2, micro_batch_size=2), "none"),
    ("gpt2", Layout(pp=2, num_microbatches=4), "none"),
    ("llama", Layout(pp=2, virtual=2, num_microbatches=4), "none"),
    ("gpt2", Layout(pp=2, num_microbatches=4, schedule="gpipe"), "none"),
    ("llama", Layout(dp=2, strategy="optim", num_microbatches=2), "none"),
    ("gpt2", Layout(dp=2, strategy="optim_grads", num_microbatches=2), "none"),
    ("llama", Layout(pp=2, num_microbatches=4), "full"),
    ("llama", Layout(tp=2, pp=2, sequence_parallel=True, num_microbatches=4), "none"),
    ("gpt2", Layout(pp=4, num_microbatches=8), "none"),
    ("llama", Layout(dp=2, tp=2, strategy="optim", micro_batch_size=2), "selective"),
]  # fmt: skip


def _flags(style: str, layout: Layout, recompute: str, bf16: bool = True):
    from engine.planning.flags import layout_flags
    from engine.planning.search import with_recompute
    from engine.pretrain import parse

    model = (GPT2 if style == "gpt2" else LLAMA) + RUN + (["--bf16"] if bf16 else [])
    cfg = with_recompute(parse(model + ["--micro-batch-size", "1"]).model, recompute)
    return cfg, model + layout_flags(cfg, layout)


def test_memory_per_rank_is_predicted_for_fourteen_layouts():
    """Parameters, gradients and optimizer state within 5%, activations (the most bytes held
    for backward at once over a whole step) within 10%, on every rank (measured: equal but
    for a few hundred bytes of RNG and bookkeeping tensors)."""
    from engine.planning.measure import measure_rank
    from engine.planning.memory import rank_memory_bytes

    for style, layout, recompute in MEMORY_LAYOUTS:
        cfg, flags = _flags(style, layout, recompute)
        for measured in run_ranks(measure_rank, layout.world, flags, 0, 1, threads=1):
            predicted = rank_memory_bytes(cfg, layout, measured["pp_rank"])
            case = (style, layout, recompute, measured, predicted)
            for kind in ("params", "grads", "optimizer"):
                assert measured[kind] == pytest.approx(predicted[kind], rel=0.05), case
            assert measured["activations"] == pytest.approx(predicted["activations"], rel=0.1), case


def _cpu_machine(memory_bytes: float):
    """This machine as a planner sees it, with made-up rates (the memory test needs none)."""
    from engine.planning.hardware import Link, Machine

    return Machine(
        name="cpu", memory_bytes=memory_bytes, gemm_rates=((1.0, 50e9),),
        attention_flops=30e9, memory_bytes_per_s=10e9, intra=Link(1e-4, 1e9),
        inter=Link(1e-4, 1e9), gpus_per_node=2, activation_bytes=2, overlaps_comm=False,
    )  # fmt: skip


def test_every_planned_layout_passes_the_engines_checks_and_the_shown_ones_run_and_fit():
    from engine.config.checks import check_layout_flags
    from engine.config.resolve import resolve
    from engine.planning.flags import layout_flags
    from engine.planning.measure import measure_rank
    from engine.planning.search import SearchSpace, plan
    from engine.pretrain import parse

    base = parse(LLAMA + RUN + ["--micro-batch-size", "1"]).model
    budget = 24e6  # bytes per rank: full-size micro-batches without recomputation do not fit
    space = SearchSpace(cp=(1, 2))
    rows = plan(base, 2, 8, _cpu_machine(budget), space, memory_fraction=1.0)
    assert len(rows) > 50 and any(not r["fits"] for r in rows) and rows[0]["fits"]
    assert {r["layout"].cp for r in rows} == {1, 2} and {r["layout"].tp for r in rows} == {1, 2}
    for row in rows:
        flags = LLAMA + RUN + layout_flags(row["cfg"], row["layout"])
        assert check_layout_flags(resolve(parse(flags), 2), 2) == row["layout"].dp
    proposed = [r for r in rows if r["fits"]][:6]
    for row in proposed:
        layout = row["layout"]
        flags = LLAMA + RUN + ["--bf16"] + layout_flags(row["cfg"], layout)
        for measured in run_ranks(measure_rank, 2, flags, 0, 1, threads=1):
            held = sum(measured[k] for k in ("params", "grads", "optimizer", "activations"))
            assert held <= budget, (layout, row["recompute"], measured)


def test_published_megatron_results_are_predicted_within_15_percent():
    from engine.planning import published

    efficiency, table = published.rows()
    assert 0.3 < efficiency < 0.9
    anchor = next(r for r in table if r["run"] == f"weak {published.ANCHOR}")
    assert anchor["error"] < 1e-3
    assert len(table) - 1 >= 10 and published.median_error(table) <= 0.15


def test_plan_tool_prints_the_table_and_emits_flags_the_engine_accepts(tmp_path):
    from engine.config.checks import check_layout_flags
    from engine.config.resolve import resolve
    from engine.interop.hf.architectures import model_config_from_hf
    from engine.planning.flags import model_flags
    from engine.pretrain import parse

    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(dict(
        model_type="llama", num_hidden_layers=16, hidden_size=2048, num_attention_heads=16,
        num_key_value_heads=8, intermediate_size=5632, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )))  # fmt: skip
    out = tmp_path / "rows.json"
    result = run_tool(
        "plan.py", "--hf-config", str(hf), "--seq-length", "4096", "--global-batch-size", "64",
        "--gpu", "h100", "--gpus", "16", "--emit-flags", "--top", "5", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "layouts of 16 x H100" in lines[0] and "MFU" in lines[1] and len(lines) == 8
    emitted = lines[-1].split()
    assert emitted == json.loads(out.read_text())[0]["flags"]
    model = model_flags(model_config_from_hf(json.loads(hf.read_text()))[0])
    check_layout_flags(
        resolve(parse(model + ["--seq-length", "4096", "--train-iters", "1"] + emitted), 16), 16
    )


@pytest.mark.parametrize(
    "args, match",
    [
        (["--gpu", "tpu9", "--global-batch-size", "8"], "--gpu tpu9: not a known GPU"),
        (["--calibration", "/nonexistent.json"], "--calibration /nonexistent.json: cannot be"),
        (["--gpu", "h100", "--gpus", "16"], "give --global-batch-size"),
        (["--gpu", "h100", "--gpus", "6", "--global-batch-size", "7"], "no layout of this model"),
        (["--gpu", "h100", "--gemm-efficiency", "1.5", "--global-batch-size", "8"],
         "--gemm-efficiency 1.5"),
        (["--gpu", "h100", "--gpus", "0", "--global-batch-size", "8"], "--gpus 0: give at"),
        (["--gpu", "h100", "--top", "0", "--global-batch-size", "8"], "--top 0: give at"),
        (["--gpu", "h100", "--micro-batch-sizes", "0", "--global-batch-size", "8"],
         "--micro-batch-sizes / --context-parallel-sizes 0"),
        (["--gpu", "h100", "--global-batch-size", "-8"], "give --global-batch-size (>= 1)"),
    ],
)  # fmt: skip
def test_plan_tool_refuses_bad_input_in_one_line(args, match):
    model = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "256", "--vocab-size", "1000",
             "--attention-dropout", "0.0"]  # fmt: skip
    assert match in one_line_error(run_tool("plan.py", *model, *args))


def test_plan_tool_refuses_bad_files_and_plans_a_small_model(tmp_path):
    hf, calibration = tmp_path / "config.json", tmp_path / "cal.json"
    hf.write_text("[1, 2]")
    line = one_line_error(run_tool("plan.py", "--hf-config", str(hf), "--gpu", "h100",
                                   "--global-batch-size", "8"))  # fmt: skip
    assert "not a model's config.json" in line
    calibration.write_text(json.dumps({"name": "x", "gemm_rates": [[1, 2, 3]]}))
    line = one_line_error(run_tool("plan.py", "--calibration", str(calibration)))
    assert "not a calibration file" in line
    line = one_line_error(run_tool("plan.py", "--load", str(tmp_path / "none"), "--gpu", "h100",
                                   "--global-batch-size", "8"))  # fmt: skip
    assert "--use-checkpoint-args: no checkpoint in" in line
    # a model whose sizes equal the engine's defaults (4 heads, seq 128) is still written out
    small = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
             "--seq-length", "128", "--vocab-size", "1000", "--attention-dropout", "0.0",
             "--gpu", "h100", "--gpus", "24", "--global-batch-size", "48"]  # fmt: skip
    result = run_tool("plan.py", *small, "--emit-flags")
    assert result.returncode == 0, result.stderr
    assert "--tensor-model-parallel-size" in result.stdout.splitlines()[-1]


def test_muon_in_the_planner_holds_less_state_and_adds_newton_schulz(tmp_path):
    """--optimizer muon: its weights hold 8 bytes of state where Adam's hold 12; the step
    gains a newton_schulz part, under half (plus the DP collectives) when DP2 shards the state,
    larger under TP2 duplicated (every TP rank the whole matrices) than blockwise; the tool
    plans it and emits --optimizer muon."""
    from engine.config.model import ModelConfig
    from engine.planning.hardware import datasheet_machine
    from engine.planning.memory import rank_state_bytes
    from engine.planning.muon_terms import StageShape, muon_parameters
    from engine.planning.step_time import predict_step

    cfg = ModelConfig(
        num_layers=16, hidden_size=2048, num_attention_heads=16, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=5632, swiglu=True, position_embedding_type="rope",
        normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True,
        vocab_size=32000, seq_length=4096, max_position_embeddings=4096,
    )  # fmt: skip
    machine = datasheet_machine("h100", 8)
    adam, muon = Layout(dp=2), Layout(dp=2, optimizer="muon")
    optimizer = [rank_state_bytes(cfg, layout, 0)["optimizer"] for layout in (adam, muon)]
    fewer = optimizer[0] - optimizer[1]
    assert fewer == 4 * muon_parameters(cfg, StageShape(layers=16), 1)[0] > 0
    assert "newton_schulz" not in predict_step(cfg, adam, machine)["parts"]

    def newton_schulz(**layout):
        return predict_step(cfg, Layout(optimizer="muon", **layout), machine)["parts"][
            "newton_schulz"
        ]

    whole = newton_schulz(dp=2)
    assert 0 < newton_schulz(dp=2, strategy="optim") < whole
    assert newton_schulz(tp=2, muon_tp_mode="duplicated") > newton_schulz(tp=2) > 0
    assert newton_schulz(tp=2, muon_tp_mode="distributed") > 0
    model = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "256", "--vocab-size", "1000", "--global-batch-size", "8",
             "--attention-dropout", "0.0", "--optimizer", "muon"]  # fmt: skip
    done = run_tool("plan.py", *model, "--gpu", "h100", "--gpus", "2", "--emit-flags")
    assert done.returncode == 0, done.stderr
    assert "--optimizer muon" in done.stdout.strip().splitlines()[-1]
