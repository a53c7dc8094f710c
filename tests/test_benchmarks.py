"""The pipeline, data-parallel, MoE, streaming, planner and scaling benchmarks run end to end on
tiny inputs and write the tables their closing-note numbers come from (timings are not
checked: numbers, not asserts)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.errors import ConfigError
from engine.monitor.metrics import PEAK_TFLOPS
from engine.planning.flags import layout_flags
from tests.tokenizer_files import make_hf_folder
from tools import bench_ddp, bench_moe, bench_pipeline, bench_plan, bench_scaling, bench_streaming

TINY = ["--hidden-size", "64", "--seq-length", "16", "--warmup", "0", "--steps", "1"]


def test_bench_pipeline_rows(tmp_path):
    out = tmp_path / "pipeline.json"
    argv = ["--pp", "2", "--microbatches", "2", "--num-layers", "4", *TINY, "--json", str(out)]
    assert bench_pipeline.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == [
        "gpipe",
        "1f1b",
        "interleaved",
        "interleaved+overlap",
        "zb-h1",  # (zb-v needs m >= 2p - 1, dualpipe-v m >= 2p)
    ]
    for r in rows:
        assert r["measured_s"] > 0 and r["stage_s"] > 0
        if r["schedule"] != "zb-h1":
            v = 2 if r["schedule"].startswith("interleaved") else 1
            assert abs(r["ideal_bubble"] - (1 - 2 / (2 + 1 / v))) < 1e-12
    assert rows[-1]["ideal_bubble"] < rows[1]["ideal_bubble"]  # zb-h1 below 1f1b


def test_bench_ddp_rows(tmp_path):
    out = tmp_path / "ddp.json"
    argv = ["--num-layers", "1", "--vocab-size", "128", "--repeats", "1", *TINY]
    argv += ["--strategies", "no_shard,optim_grads_params"]
    assert bench_ddp.main([*argv, "--micro-batch-size", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == [
        "DP=1 (baseline)",
        "2 x DP=1 side by side",
        "DP=2 no_shard, overlap off",
        "DP=2 no_shard, overlap on",
        "DP=2 optim_grads_params, overlap off",
        "DP=2 optim_grads_params, overlap on",
    ]
    assert rows[0]["efficiency"] == 1.0
    assert all(r["seconds_per_step"] > 0 and len(r["each_launch"]) == 1 for r in rows)


def test_bench_moe_rows(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["--num-layers", "1", "--vocab-size", "128", "--repeats", "1", "--expert-ffn", "32"]
    argv += ["--num-experts", "4", "--ep", "2", "--micro-batch-size", "1", *TINY]
    assert bench_moe.main([*argv, "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    assert list(found["steps"]) == ["dense", "MoE EP 1"]
    assert list(found["scaling"]) == ["2 x EP 1 side by side", "EP 2 (DP 2)"]
    assert {"layer (grouped)", "experts (loop)", "router (grouped)"} <= set(found["layer"])
    # the experts of EP 2 are split over the ranks: less state per rank than EP 1's
    assert found["state_bytes"]["EP 2 (DP 2)"] < found["state_bytes"]["MoE EP 1"]
    for name, peak in found["peak_bytes"].items():  # the state and the activations held
        assert peak > found["state_bytes"][name], name
    assert all(t > 0 for times in found["steps"].values() for t in times)


def test_bench_streaming_rows(tmp_path, corpus, tokenizer_model):
    hf = make_hf_folder(corpus["jsonl"], str(tmp_path / "hf"))
    out = tmp_path / "streaming.json"
    argv = ["--target-mb", "1", "--shards", "2", "--seq-length", "64", "--shuffle-buffer", "32"]
    argv += ["--sentencepiece-model", tokenizer_model, "--hf-tokenizer", hf, "--cpu-models"]
    assert bench_streaming.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    loaders = result["loaders"]
    assert [(r["tokenizer"], r["workers"]) for r in loaders] == [
        ("sentencepiece", 1),
        ("sentencepiece", 2),
        ("hf-bpe", 1),
        ("hf-bpe", 2),
    ]
    assert all(r["samples"] > 0 and r["tokens_per_s"] > 0 for r in loaders)
    consumers = result["consumers"]
    assert [c["consumer"].split(" on ")[0] for c in consumers] == ["125M", "1.3B"]
    for c in consumers:  # 45% of the H100's peak over the FLOPs per token
        h100 = 0.45 * PEAK_TFLOPS[("H100 SXM", "bf16")] * 1e12
        assert abs(c["tokens_per_s"] * c["flops_per_token"] - h100) < 1e-6 * h100


def _machine_file(tmp_path) -> str:
    from engine.planning.hardware import Link, Machine

    path = str(tmp_path / "machine.json")
    Machine(
        name="cpu", memory_bytes=1e9, gemm_rates=((64.0, 20e9), (256.0, 50e9)),
        attention_flops=30e9, memory_bytes_per_s=10e9, intra=Link(1e-4, 1e9),
        inter=Link(1e-4, 1e9), gpus_per_node=2, activation_bytes=4, overlaps_comm=False,
        overheads={"step": 1e-3, "per_microbatch": 1e-4, "per_microbatch_layer": 1e-4},
    ).to_json(path)  # fmt: skip
    return path


def test_bench_scaling_rows_and_figure(tmp_path):
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    argv = ["--num-layers", "2", "--vocab-size", "128", "--world-sizes", "1", "2",
            "--predict-sizes", "4", "--global-batch-size", "8", "--calibration",
            _machine_file(tmp_path), *TINY, "--json", str(out), "--png", str(png)]  # fmt: skip
    assert bench_scaling.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["world"], r["measured"]) for r in rows] == [
        ("weak", 1, True), ("weak", 2, True), ("weak", 4, False),
        ("strong", 1, True), ("strong", 2, True), ("strong", 4, False),
    ]  # fmt: skip
    for r in rows:
        assert r["predicted_tokens_per_s"] > 0 and r["efficiency"] > 0
        assert not r["measured"] or r["tokens_per_s"] > 0
    weak, strong = rows[:3], rows[3:]
    assert weak[0]["efficiency"] == 1.0 and strong[0]["efficiency"] == 1.0
    assert [r["tokens_per_step"] for r in weak] == [64, 128, 256]  # per-rank work fixed
    assert {r["tokens_per_step"] for r in strong} == {128}  # the global batch fixed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plan_rows(tmp_path):
    """Three of the layouts measured (one rank with recomputation, interleaved PP, MoE with
    EP), each of the others' flags checked as a run would check them, at no run's cost."""
    from engine.planning.search import with_recompute
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    out = tmp_path / "plan.json"
    measured = ["1 rank, selective", "PP2 interleaved v2 m4", "MoE DP2 EP2"]
    argv = ["--num-layers", "4", "--vocab-size", "128", "--calibration",
            _machine_file(tmp_path), *TINY, "--hidden-size", "128",  # 2 heads for TP 2
            "--json", str(out), "--only", *measured]  # fmt: skip
    assert bench_plan.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["layout"] for r in result["cpu"]["rows"]] == measured
    for r in result["cpu"]["rows"]:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0
    assert result["published"]["median_error"] <= 0.15
    shape = SimpleNamespace(num_layers=4, hidden_size=128, seq_length=16, vocab_size=128)
    cases = bench_plan.layout_cases(shape)
    assert len(cases) == len(bench_plan.CPU_LAYOUTS) + len(bench_plan.MOE_LAYOUTS) >= 16
    for (_, layout, recompute), model in cases:  # ConfigError where a run would refuse one
        cfg = with_recompute(parse(model + ["--micro-batch-size", "1"]).model, recompute)
        prepare(parse(model + layout_flags(cfg, layout)), layout.world)
    with pytest.raises(ConfigError, match="--only 'TP3': no such layout"):
        bench_plan.main([*argv[:-4], "--only", "TP3"])
