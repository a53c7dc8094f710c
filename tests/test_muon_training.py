"""--optimizer muon in training: Muon for the 2-D hidden weights and Adam for the rest, under
TP (the whole matrix gathered, --muon-tp-mode duplicated, or its Gram products summed,
distributed), TP x DP and PP, and with the state
sharded over DP by each strategy, against one process over three steps."""

from __future__ import annotations

import re

import pytest


def _args(dataset_prefix, tokenizer_model, tmp_path, name, **extra):
    from tests.test_training import base_args

    flags = {"--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "256",
             "--num-layers": "2", "--train-iters": "3", "--attention-dropout": "0.0",
             "--hidden-dropout": "0.0", "--log-jsonl": str(tmp_path / f"{name}.jsonl"),
             "--optimizer": "muon", "--muon-fp32-matmul-prec": "high", "--lr": "0.02",
             "--muon-use-nesterov": True, "--swiglu": True, "--group-query-attention": True,
             "--num-query-groups": "2", **extra}  # fmt: skip
    return base_args(dataset_prefix, tokenizer_model, **flags)


LAYOUTS = {
    "tp2": (2, {"--tensor-model-parallel-size": "2", "--muon-tp-mode": "duplicated"}),
    "tp2-dp2": (4, {"--tensor-model-parallel-size": "2", "--muon-tp-mode": "duplicated",
                    "--sequence-parallel": True}),
    "pp2": (2, {"--pipeline-model-parallel-size": "2"}),
    "tp2-distributed": (2, {"--tensor-model-parallel-size": "2",
                            "--muon-tp-mode": "distributed"}),
}  # fmt: skip


def test_muon_steps_equal_one_process_under_each_layout(dataset_prefix, tokenizer_model, tmp_path):
    """Every layout's losses within 1e-6 relative of one process's (the second and third
    steps' losses follow the Muon updates); TP2 with blockwise (each shard its own matrix)
    differs, and Muon trains otherwise than Adam."""
    from tests.test_training import losses, pretrain

    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "one"))
    one = losses(tmp_path / "one.jsonl")
    assert sorted(one) == [1, 2, 3]
    for name, (world, layout) in LAYOUTS.items():
        pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, name, **layout))
        many = losses(tmp_path / f"{name}.jsonl")
        apart = [abs(many[s] - one[s]) / one[s] for s in one]
        assert max(apart) < 1e-6, (name, apart)
    blockwise = {"--tensor-model-parallel-size": "2", "--muon-tp-mode": "blockwise"}
    pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, "blockwise", **blockwise))
    adam = {"--optimizer": "adam", "--muon-fp32-matmul-prec": None, "--muon-use-nesterov": None}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "adam", **adam))
    for other in ("blockwise", "adam"):
        theirs = losses(tmp_path / f"{other}.jsonl")
        assert abs(theirs[3] - one[3]) / one[3] > 1e-4, other


SHARDED = {  # small buckets: Muon matrices cut between the DP ranks' shards
    "dp2-dist-muon": (2, {"--optimizer": "dist_muon"}),
    "tp2-dp2-distopt": (4, {"--tensor-model-parallel-size": "2", "--muon-tp-mode": "duplicated",
                            "--use-distributed-optimizer": True}),
    "tp2-dp2-zero2": (4, {"--tensor-model-parallel-size": "2", "--muon-tp-mode": "distributed",
                          "--use-megatron-fsdp": True,
                          "--data-parallel-sharding-strategy": "optim_grads"}),
    "tp2-dp2-zero3": (4, {"--tensor-model-parallel-size": "2", "--muon-tp-mode": "duplicated",
                          "--use-megatron-fsdp": True,
                          "--data-parallel-sharding-strategy": "optim_grads_params"}),
}  # fmt: skip


def test_sharded_muon_equals_one_process_under_each_strategy(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    """With the optimizer state sharded (the distributed optimizer, ZeRO-2, ZeRO-3), each DP
    rank orthogonalises only the whole matrices it owns (the start line says how many) and
    the losses equal one process's within 1e-6 relative (and DP2's without sharding exactly,
    without clipping)."""
    from tests.test_training import losses, pretrain

    small = {"--ddp-bucket-size": "30000"}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "one", **small))
    one = losses(tmp_path / "one.jsonl")
    for name, (world, layout) in SHARDED.items():
        capfd.readouterr()
        pretrain(world, _args(dataset_prefix, tokenizer_model, tmp_path, name, **small, **layout))
        many = losses(tmp_path / f"{name}.jsonl")
        apart = [abs(many[s] - one[s]) / one[s] for s in one]
        assert sorted(many) == [1, 2, 3] and max(apart) < 1e-6, (name, apart)
        # 2 layers x 4 matrices (qkv, proj, fc1, fc2) and the learned position embedding,
        # shared by the two DP ranks
        found = re.search(r"orthogonalises (\d+) of the (\d+) matrices it holds parts of",
                          capfd.readouterr().out)  # fmt: skip
        assert found and found[2] == "9" and 3 <= int(found[1]) <= 6, (name, found)
    # the sharded step's arithmetic is the unsharded one's: DP2 with and without sharding
    # equal bit for bit (without clipping, whose norm sums the squares in another order)
    for name, extra in (("dp2", {}), ("dp2-sharded", {"--optimizer": "dist_muon"})):
        args = _args(dataset_prefix, tokenizer_model, tmp_path, name, **small, **extra,
                     **{"--clip-grad": "0.0"})  # fmt: skip
        pretrain(2, args)
    assert losses(tmp_path / "dp2.jsonl") == losses(tmp_path / "dp2-sharded.jsonl")


def test_moe_experts_each_their_own_matrix_under_expert_parallelism(
    dataset_prefix, tokenizer_model, tmp_path
):
    """A mixture of experts with Muon (the router and each expert's two projections each a
    matrix of its own): EP2 (the experts' state replicated, then sharded over the expert
    data-parallel group by --optimizer dist_muon) equals one process within 1e-6 relative."""
    from tests.test_training import losses, pretrain

    moe = {"--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "48",
           "--moe-aux-loss-coeff": "0.01"}  # fmt: skip
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "one", **moe))
    one = losses(tmp_path / "one.jsonl")
    ep2 = {"--expert-model-parallel-size": "2", **moe}
    for name, extra in (("ep2", {}), ("ep2-dist", {"--optimizer": "dist_muon"})):
        pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, name, **ep2, **extra))
        many = losses(tmp_path / f"{name}.jsonl")
        apart = [abs(many[s] - one[s]) / one[s] for s in one]
        assert sorted(many) == [1, 2, 3] and max(apart) < 1e-6, (name, apart)


def test_the_qkv_split_changes_the_update(dataset_prefix, tokenizer_model, tmp_path, capfd):
    """--muon-no-split-qkv orthogonalises the fused QKV weight as one matrix, not as its Q,
    K and V: the same first loss, other losses after. The start says which weights get
    Muon."""
    from tests.test_training import losses, pretrain, records

    logged = {"--log-update-to-weight-ratios": True}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "split", **logged))
    rms = records(tmp_path / "split.jsonl")[1]  # the second step's
    assert 0.7 < rms["update_rms/muon"] / rms["lr"] < 1.3  # spectral scale: an RMS near lr
    assert rms["update_rms/adam"] > 0
    line = next(x for x in capfd.readouterr().out.splitlines() if x.startswith("optimizer: "))
    muon, adam = line.split("; ")
    assert "layers.*.self_attention.linear_qkv.weight" in muon and "norm" not in muon
    assert "embedding.position_embeddings.weight" in muon  # 2-D and not flagged (megatron-core)
    assert "embedding.word_embeddings.weight" in adam and "layernorm.weight" in adam
    extra = {"--muon-no-split-qkv": True}
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "whole", **extra))
    split, whole = losses(tmp_path / "split.jsonl"), losses(tmp_path / "whole.jsonl")
    assert split[1] == whole[1] and abs(split[3] - whole[3]) / split[3] > 1e-5


def test_muon_resumes_bit_for_bit_reshards_and_refuses_adam(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Muon's momentum is in the checkpoint: a run stopped at step 2 and resumed gives the
    straight run's losses bit for bit; resumed under TP2 (duplicated) and with the state
    sharded over DP2 (--optimizer dist_muon) within 1e-6; resumed with
    --optimizer adam it is refused in one line, unless --no-load-optim."""
    from tests.test_training import losses, pretrain, straight_and_resumed

    four = {"--train-iters": "4"}

    def args_of(name, **extra):
        return _args(dataset_prefix, tokenizer_model, tmp_path, name, **four, **extra)

    straight, resumed = straight_and_resumed(args_of, tmp_path, 2)
    assert resumed == straight and sorted(straight) == [1, 2, 3, 4]
    ckpt = str(tmp_path / "ckpt")
    tp2 = {"--load": ckpt, "--tensor-model-parallel-size": "2", "--muon-tp-mode": "duplicated"}
    pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, "tp2", **four, **tp2))
    apart = [abs(v - straight[s]) / straight[s] for s, v in losses(tmp_path / "tp2.jsonl").items()]
    assert len(apart) == 2 and max(apart) < 1e-6, apart
    sharded = {"--load": ckpt, "--optimizer": "dist_muon", "--ddp-bucket-size": "30000"}
    pretrain(2, _args(dataset_prefix, tokenizer_model, tmp_path, "dist", **four, **sharded))
    apart = [abs(v - straight[s]) / straight[s] for s, v in losses(tmp_path / "dist.jsonl").items()]
    assert len(apart) == 2 and max(apart) < 1e-6, apart
    adam = {"--optimizer": "adam", "--muon-fp32-matmul-prec": None, "--muon-use-nesterov": None,
            "--load": ckpt, **four}  # fmt: skip
    with pytest.raises(AssertionError, match="holds the state of --optimizer muon, and this"):
        pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "adam", **adam))
    adam["--no-load-optim"] = True
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "fresh", **adam))
    assert sorted(losses(tmp_path / "fresh.jsonl")) == [3, 4]


def test_bench_optimizers_sweeps_both_and_compares_their_best(
    dataset_prefix, tokenizer_model, tmp_path
):
    """tools/bench_optimizers.py at a tiny size: Adam and Muon at two rates each, a row per
    rate, each one's best marked, the same first loss (same seed: the same weights and data)
    and other losses after, the comparison line, JSON and plot."""
    import json

    from tests.cli import run_tool

    done = run_tool(
        "bench_optimizers.py", "--adam-lrs", "1e-3", "1e-2", "--muon-lrs", "1e-3", "1e-2",
        "--seeds", "1", "--train-iters", "3", "--average-last", "2", "--num-layers", "1",
        "--hidden-size", "64", "--seq-length", "16", "--data-path", dataset_prefix,
        "--tokenizer-model", tokenizer_model, "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads((tmp_path / "bench_optimizers.json").read_text())
    assert [(row["optimizer"], row["lr"]) for row in found["rows"]] == [
        ("adam", 1e-3), ("adam", 1e-2), ("muon", 1e-3), ("muon", 1e-2)
    ]  # fmt: skip
    adam, muon = found["runs"]["adam 0.01"][0]["loss"], found["runs"]["muon 0.01"][0]["loss"]
    assert adam[0] == muon[0] and abs(adam[2] - muon[2]) > 1e-4, (adam, muon)
    assert set(found["best"]) == {"adam", "muon"} and found["comparison"] is not None
    assert "Newton-Schulz" in done.stdout and "*" in done.stdout
    assert (tmp_path / "bench_optimizers.png").stat().st_size > 10_000
