"""--optimizer muon in training: Muon for the 2-D hidden weights and Adam for the rest, under
TP (the whole matrix gathered, --muon-tp-mode duplicated), TP x DP and PP, against one
process over three steps."""

from __future__ import annotations

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
    straight run's losses bit for bit; resumed under TP2 (duplicated) within 1e-6; resumed with
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
    adam = {"--optimizer": "adam", "--muon-fp32-matmul-prec": None, "--muon-use-nesterov": None,
            "--load": ckpt, **four}  # fmt: skip
    with pytest.raises(AssertionError, match="holds the state of --optimizer muon, and this"):
        pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "adam", **adam))
    adam["--no-load-optim"] = True
    pretrain(1, _args(dataset_prefix, tokenizer_model, tmp_path, "fresh", **adam))
    assert sorted(losses(tmp_path / "fresh.jsonl")) == [3, 4]
