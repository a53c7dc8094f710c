"""Megatron-LM's flags: accepted without effect (named in one line at start), refused in one
line where the feature is missing, its defaults and required flags, sample-based training,
grouped-query attention and the tokenizer default."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import pytest

from engine.config.megatron.compat import check_megatron_flags, no_effect_line, table_answers
from engine.errors import ConfigError
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.distributed import run_ranks
from tests.harness import engine_steps
from tests.test_training import ROOT, base_args, pretrain, records

UNSIZED = [
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
]
SHAPE = UNSIZED + ["--train-iters", "4"]
# As the Llama-3 and Mixtral examples pass them (values included).
NO_EFFECT = [
    "--use-mcore-models",
    *("--attention-backend", "fused"),
    "--no-masked-softmax-fusion",
    "--cross-entropy-loss-fusion",
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--manual-gc",
    *("--empty-unused-memory-level", "1"),
    "--log-throughput",
    *("--ckpt-format", "torch_dist"),
    *("--position-embedding-type", "rope", "--no-position-embedding"),
    # as Megatron-LM's FSDP examples pass them
    "--fsdp-double-buffer",
    "--fsdp-manual-registration",
]


def test_flags_without_effect_are_accepted_and_named_in_one_line():
    cfg = parse(SHAPE + NO_EFFECT)
    cfg = prepare(cfg, 1)
    line = no_effect_line(cfg.megatron)
    named = [a for a in NO_EFFECT if a.startswith("--") and a != "--position-embedding-type"]
    assert line.startswith("Megatron-LM flags accepted without effect here: ")
    assert line.removeprefix("Megatron-LM flags accepted without effect here: ").split(
        ", "
    ) == sorted(named, key=line.index)
    assert set(named) <= set(table_answers())
    assert no_effect_line(parse(SHAPE).megatron) is None  # nothing given, nothing said


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fp4-format", "e2m1"], "--fp4-format: FP4 training, Transformer Engine's"),
        (["--moe-latent-size", "8"], "--moe-latent-size: expert parallelism and the rest"),
        (["--ckpt-format", "torch"], "--ckpt-format torch: only torch_dist"),
        (["--no-position-embedding"], "--no-position-embedding goes with --position-embedding"),
    ],
)
def test_missing_features_are_refused_in_one_line(extra, message):
    cfg = parse(SHAPE + extra)
    with pytest.raises(ConfigError) as err:
        check_megatron_flags(cfg.megatron, cfg.model.position_embedding_type)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_fsdp_flags_follow_megatron_lm():
    """Megatron-LM requires --ckpt-format fsdp_dtensor with --use-megatron-fsdp; this engine
    writes its own checkpoints either way."""
    fsdp = SHAPE + ["--ckpt-format", "fsdp_dtensor", "--use-megatron-fsdp"]
    cfg = parse(fsdp)
    check_megatron_flags(cfg.megatron, cfg.model.position_embedding_type, megatron_fsdp=True)
    cfg = prepare(cfg, 1)
    assert cfg.parallel.sharding_strategy() == "optim_grads_params"
    assert "--ckpt-format" in no_effect_line(cfg.megatron)
    cfg = parse(SHAPE + ["--ckpt-format", "fsdp_dtensor"])
    with pytest.raises(ConfigError, match="--ckpt-format fsdp_dtensor: only torch_dist"):
        check_megatron_flags(cfg.megatron, cfg.model.position_embedding_type)
    # the strategy alone has no effect in Megatron-LM either: accepted and named
    cfg = parse(SHAPE + ["--data-parallel-sharding-strategy", "no_shard"])
    cfg = prepare(cfg, 1)
    assert cfg.parallel.sharding_strategy() == "no_shard"
    line = no_effect_line(cfg.megatron, cfg.model, cfg.runtime, cfg.parallel)
    assert line.endswith("--data-parallel-sharding-strategy (without --use-megatron-fsdp)")


def test_expert_parallel_flags_are_one_line_exit_2_through_the_launcher(tmp_path):
    moe = ["--num-experts", "8", "--expert-model-parallel-size", "2"]
    moe += ["--expert-tensor-parallel-size", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "engine.launch", "--nproc-per-node", "2", "-m", "engine.pretrain"]
        + SHAPE
        + moe,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    # experts split over 2 ranks (ETP 2) take no biases here: refused before any rank starts
    assert len(lines) == 1 and "--expert-tensor-parallel-size 2 with biases" in lines[0], (
        result.stderr
    )


def test_required_flags_are_named_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "engine.pretrain", "--mock-data", "--train-iters", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    expected = (
        "--num-layers, --hidden-size, --num-attention-heads, --seq-length, "
        "--max-position-embeddings, --micro-batch-size are required (as in Megatron-LM)"
    )
    assert result.stderr.strip().splitlines() == [f"error: {expected}; see --help"]
    with pytest.raises(ConfigError, match="give --train-iters N or --train-samples N"):
        prepare(parse(UNSIZED), 1)


def test_megatron_defaults():
    """Megatron-LM's defaults (megatron/training/arguments.py and its config dataclasses;
    pretrain_gpt.py's tokenizer)."""
    cfg = parse(SHAPE)
    assert cfg.logging.log_interval == 100 and cfg.evaluation.eval_iters == 100
    assert cfg.evaluation.eval_interval is None and cfg.data.num_workers == 2
    assert cfg.optimizer.lr_decay_style == "linear" and cfg.data.split == "969,30,1"
    shape = UNSIZED[:-5]  # no --mock-data or tokenizer flags
    bpe = parse(shape + ["--vocab-file", "v.json", "--merge-file", "m.txt"])
    assert bpe.tokenizer.tokenizer_type == "GPT2BPETokenizer"
    assert parse(shape).tokenizer.tokenizer_type == "SentencePieceTokenizer"


def test_group_query_attention_as_megatron_reads_it():
    heads = ["--num-attention-heads", "4"]
    assert parse(SHAPE + heads + ["--num-query-groups", "2"]).model.query_groups == 4
    gqa = parse(SHAPE + heads + ["--group-query-attention", "--num-query-groups", "2"])
    assert gqa.model.query_groups == 2
    assert parse(SHAPE + ["--group-query-attention"]).model.query_groups == 1
    alone = parse(SHAPE + heads + ["--num-query-groups", "2"])
    assert no_effect_line(alone.megatron, alone.model).endswith(
        "--num-query-groups (without --group-query-attention)"
    )
    with pytest.raises(ConfigError, match="--num-query-groups must be at least 1"):
        prepare(parse(SHAPE + ["--group-query-attention", "--num-query-groups", "0"]), 1)


def test_train_samples_set_the_iterations_and_iteration_flags_are_refused():
    by_samples = UNSIZED
    cfg = parse(by_samples + ["--train-samples", "21", "--global-batch-size", "4"])
    cfg = prepare(cfg, 2)
    assert cfg.training.train_iters == 5  # whole global batches, as Megatron-LM counts
    both = parse(SHAPE + ["--train-samples", "64"])
    with pytest.raises(ConfigError, match="--train-iters and --train-samples both"):
        prepare(both, 1)
    mixed = parse(by_samples + ["--train-samples", "64", "--lr-decay-iters", "3"])
    with pytest.raises(ConfigError, match="--lr-decay-iters goes with --train-iters"):
        prepare(mixed, 1)


def test_a_run_by_samples_with_megatron_flags_trains(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    """The Llama-3 example's way of giving the length, warm-up and decay, with its flags that
    have no effect here; the line naming them is printed once."""
    log = str(tmp_path / "m.jsonl")
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--train-iters": None,
            "--lr-warmup-iters": None,
            "--train-samples": "44",
            "--lr-decay-samples": "40",
            "--lr-warmup-fraction": "0.25",
            "--lr-decay-style": "linear",
            "--num-workers": None,  # Megatron-LM's default: 2 data-loader workers per rank
            "--log-jsonl": log,
        },
    )
    pretrain(2, args + NO_EFFECT[:13])  # all but those that change the position embedding
    found = [r for r in records(log) if "split" not in r]
    assert [r["iteration"] for r in found] == [1, 2, 3, 4, 5]  # 44 // 8 global batches
    # warm-up 0.25 x 40 = 10 samples, then linear to --min-lr at 40 samples; update k has seen
    # 8k samples: 0, peak x 8/10, then (40 - 8k) / 30 of the way from min to peak
    peak, floor = 3e-3, 3e-4
    decayed = [floor + (peak - floor) * (40 - s) / 30 for s in (16, 24, 32)]
    assert [r["lr"] for r in found] == pytest.approx([0.0, peak * 0.8, *decayed], rel=1e-12)
    out = capfd.readouterr().out
    lines = [x for x in out.splitlines() if "Megatron-LM flags accepted without effect here: " in x]
    assert len(lines) == 1 and "--use-mcore-models" in lines[0], lines


def test_finetune_no_load_optim_and_no_load_rng(dataset_prefix, tokenizer_model, tmp_path, capfd):
    """Megatron-LM's meanings: --finetune keeps only the weights (iteration, samples, schedule
    start at zero); --no-load-optim keeps the iteration and samples but restarts the optimizer
    and the learning-rate schedule; --no-load-rng re-seeds the random streams."""
    ckpt = str(tmp_path / "ckpt")

    def run(name: str, **extra) -> list[dict]:
        log = str(tmp_path / f"{name}.jsonl")
        args = base_args(
            dataset_prefix, tokenizer_model, **{"--log-jsonl": log, "--train-iters": "6"}, **extra
        )
        pretrain(1, args)
        return [r for r in records(log) if "split" not in r]

    straight = run("straight")
    run("first", **{"--save": ckpt, "--exit-interval": "3"})
    exact = run("exact", **{"--load": ckpt})
    assert [r["lm_loss"] for r in exact] == [r["lm_loss"] for r in straight[3:]]
    no_optim = run("no_optim", **{"--load": ckpt, "--no-load-optim": True})
    assert [r["iteration"] for r in no_optim] == [4, 5, 6]
    assert no_optim[0]["consumed_samples"] == straight[3]["consumed_samples"]
    # warm-up (--lr-warmup-iters 2) starts again: 0, lr / 2, lr
    assert [r["lr"] for r in no_optim] == [straight[i]["lr"] for i in range(3)]
    assert no_optim[0]["lm_loss"] == exact[0]["lm_loss"]  # same weights, same batch
    finetune = run("finetune", **{"--load": ckpt, "--finetune": True})
    assert [r["iteration"] for r in finetune] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in finetune] == [r["lr"] for r in straight]
    assert finetune[0]["consumed_samples"] == straight[0]["consumed_samples"]
    assert finetune[0]["lm_loss"] < straight[0]["lm_loss"] - 0.1  # trained weights
    no_rng = run("no_rng", **{"--load": ckpt, "--no-load-rng": True})
    assert [r["iteration"] for r in no_rng] == [4, 5, 6]
    assert no_rng[0]["lm_loss"] != exact[0]["lm_loss"]  # other dropout masks
    out = capfd.readouterr().out
    assert "re-seeded random streams (--no-load-rng)" in out
    assert "start afresh (--no-load-optim)" in out and "fine-tuning from the weights" in out


def test_exit_signal_handler_and_exit_duration_save_and_exit_cleanly(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    """SIGTERM reaching one rank (TRIPOD_FAULT_SIGTERM_AT sends a real one) with
    --exit-signal-handler: every rank finishes that iteration, the run saves and exits with code
    0, and the resumed run continues as if never stopped. --exit-duration-in-mins 1e-6 stops
    after the first iteration the same way (0 would mean no limit, as in Megatron-LM)."""

    def args(log: str, **extra):
        common = {"--log-jsonl": str(tmp_path / log), "--train-iters": "6"}
        return base_args(dataset_prefix, tokenizer_model, **common, **extra)

    pretrain(2, args("straight.jsonl"))
    ckpt = str(tmp_path / "ckpt")
    codes = pretrain(
        2,
        args("stopped.jsonl", **{"--save": ckpt, "--exit-signal-handler": True}),
        env={"TRIPOD_FAULT_SIGTERM_AT": "1:3"},
    )
    assert codes == [0, 0]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert "exiting at iteration 3: received SIGTERM (--exit-signal-handler)" in (
        capfd.readouterr().out
    )
    other = str(tmp_path / "other")
    usr1 = {"--save": other, "--exit-signal-handler": True, "--exit-signal": "SIGUSR1"}
    env = {"TRIPOD_FAULT_SIGTERM_AT": "0:2", "TRIPOD_FAULT_SIGNAL": "SIGUSR1"}
    assert pretrain(2, args("usr1.jsonl", **usr1), env=env) == [0, 0]
    assert "exiting at iteration 2: received SIGUSR1 (--exit-signal-handler)" in (
        capfd.readouterr().out
    )
    pretrain(2, args("resumed.jsonl", **{"--load": ckpt}))
    straight = [r["lm_loss"] for r in records(tmp_path / "straight.jsonl") if "split" not in r]
    stopped = [r["lm_loss"] for r in records(tmp_path / "stopped.jsonl") if "split" not in r]
    resumed = [r["lm_loss"] for r in records(tmp_path / "resumed.jsonl") if "split" not in r]
    assert stopped + resumed == straight
    timed = str(tmp_path / "timed")
    timed_args = args("timed.jsonl", **{"--save": timed, "--exit-duration-in-mins": "1e-6"})
    assert pretrain(1, timed_args) == [0]
    assert (tmp_path / "timed" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "ran for more than 1e-06 minutes (--exit-duration-in-mins)" in capfd.readouterr().out


def test_per_split_paths_train_and_a_short_unweighted_blend_is_one_line(
    dataset_prefix, tokenizer_model, tmp_path
):
    log = str(tmp_path / "m.jsonl")
    per_split = {
        "--data-path": None,
        "--split": None,
        "--train-data-path": ["1.0", dataset_prefix],
        "--valid-data-path": [dataset_prefix],
        "--train-iters": "3",
        "--log-jsonl": log,
    }
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **per_split))
    found = records(log)
    assert [r["iteration"] for r in found if "split" not in r] == [1, 2, 3]
    assert [r["split"] for r in found if "split" in r] == ["valid"]  # no test paths: no test
    # Prefixes alone give one epoch of each, as in Megatron-LM; a longer run is one line.
    short = base_args(
        dataset_prefix,
        tokenizer_model,
        **{"--data-path": [dataset_prefix, dataset_prefix], "--train-iters": "100000"},
    )
    result = subprocess.run(
        [sys.executable, "-m", "engine.pretrain", *short, "--device", "cpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "the train split has" in lines[0] and "give weights (0.5 A 0.5 B)" in lines[0]


def test_profile_writes_a_torch_trace_of_the_profiled_steps(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Without a GPU, --profile runs torch.profiler over the steps Megatron-LM's schedule
    names and writes the trace where Megatron-LM does, beside --tensorboard-dir."""
    import gzip
    import json

    tb = tmp_path / "run" / "tb"
    profiled = {
        "--train-iters": "5",
        "--profile": True,
        "--profile-step-start": "2",
        "--profile-step-end": "4",
        "--tensorboard-dir": str(tb),
    }
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **profiled))
    with gzip.open(tmp_path / "run" / "torch_profile" / "rank-0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any("aten::mm" in str(e.get("name")) for e in events)
    without_dir = parse(SHAPE + ["--profile"])
    with pytest.raises(ConfigError, match="give --tensorboard-dir DIR"):
        prepare(without_dir, 1)


def test_apply_layernorm_1p_stores_norm_weights_centred_on_zero():
    """--apply-layernorm-1p: every norm weight starts at 0 and is applied as 1 + weight, so
    the model computes what the plain one does, gradients included."""
    import torch

    from engine.model import BuildContext, GPTModel
    from tests.harness import tiny_config

    logits, grads = [], []
    for centred in (False, True):
        cfg = tiny_config("llama", apply_layernorm_1p=centred, qk_layernorm=True)
        model = GPTModel(cfg, BuildContext(cfg, seed=3))
        norms = [p for n, p in model.named_parameters() if "layernorm.weight" in n]
        assert len(norms) == 4 * 4 + 1 and all(bool((p == float(not centred)).all()) for p in norms)
        tokens = torch.randint(
            0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0)
        )
        out = model(tokens=tokens)
        out.float().pow(2).mean().backward()
        logits.append(out.detach())
        grads.append([p.grad for p in norms])
    assert torch.equal(logits[0], logits[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_data_args_files(dataset_prefix, tmp_path):
    """--data-args-path and --per-split-data-args-path, read as Megatron-LM reads them."""
    import json

    listed = tmp_path / "blend.txt"
    listed.write_text(f"0.3 {dataset_prefix}\n0.7 {dataset_prefix}\n")
    flags = UNSIZED[:-5] + ["--train-iters", "4"]  # no --mock-data or tokenizer flags
    data = parse(flags + ["--data-args-path", str(listed)]).data.with_path_files()
    data.validate()
    assert data.data_path == ["0.3", dataset_prefix, "0.7", dataset_prefix]
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": f"1 {dataset_prefix}", "valid": [dataset_prefix]}))
    data = parse(flags + ["--per-split-data-args-path", str(per_split)]).data.with_path_files()
    data.validate()
    assert data.per_split_paths == (["1", dataset_prefix], [dataset_prefix], [])
    (tmp_path / "bad.json").write_text("{train: 1}")
    for extra, message in (
        (["--data-args-path", str(tmp_path / "none.txt")], "none.txt: cannot be read"),
        (["--per-split-data-args-path", str(tmp_path / "bad.json")], "bad.json: not JSON"),
        (["--data-args-path", str(listed), "--data-path", "x"], "both name the data"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse(flags + extra).data.with_path_files().validate()


def test_rotary_percent_rotates_the_first_channels_as_megatron_core():
    """--rotary-percent 0.5: RoPE on the first half of each head's channels, the rest passed
    through, equal to megatron-core's tables (RotaryEmbedding) and rotation
    (_apply_rotary_pos_emb_bshd) on CPU (its get_emb moves the table to CUDA, so the table is
    taken from get_freqs_non_repeated and laid out as get_emb lays it out)."""
    import torch

    from engine.config.model import ModelConfig
    from engine.model import BuildContext
    from engine.model.attention import SelfAttention
    from engine.model.rope import RotaryEmbedding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    cfg = ModelConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        position_embedding_type="rope",
        rotary_percent=0.5,
        rotary_base=500,
        vocab_size=64,
    )
    cfg.validate()
    assert cfg.rotary_dim == 8
    theirs_table = rotary_pos_embedding.RotaryEmbedding(
        kv_channels=16, rotary_percent=0.5, rotary_base=500, use_cpu_initialization=True
    )
    freqs = theirs_table.get_freqs_non_repeated(12)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    x = torch.randn(12, 2, 4, 16, dtype=torch.float64)
    theirs = rope_utils._apply_rotary_pos_emb_bshd(x, freqs.double())
    attention = SelfAttention(BuildContext(cfg), 0)
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rotary_base)(torch.arange(12, device=x.device))
    ours = attention._rotate(x, (cos.double(), sin.double()))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., 8:], x[..., 8:])
    with pytest.raises(ConfigError, match="must be in"):
        ModelConfig(rotary_percent=0.0).validate()
    # it trains (TP 2: each rank's heads rotate their first channels), and the Hugging Face
    # export, whose Llama rotates every channel, says so in one line
    rope = ["--position-embedding-type", "rope", "--rotary-percent", "0.5"]
    rope += ["--tensor-model-parallel-size", "2"]
    for _, _, losses, _ in run_ranks(engine_steps, 2, rope):
        assert losses[-1] < losses[0]
    from engine.interop.hf.architectures import style_of

    llama = dataclasses.replace(cfg, normalization="RMSNorm", swiglu=True, add_bias_linear=False)
    with pytest.raises(ConfigError, match="--rotary-percent 0.5 \\(Llama rotates every"):
        style_of(llama)


def test_rope_scaling_gives_megatron_core_and_transformers_frequencies():
    """--use-rope-scaling (Llama 3.x) against megatron-core's own scaling and transformers'
    "llama3" rope_type; --rotary-seq-len-interpolation-factor against megatron-core's
    positions / factor."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.config.model import ModelConfig
    from engine.model.rope import RotaryEmbedding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings import rotary_pos_embedding

    base = dict(num_layers=1, hidden_size=128, num_attention_heads=2, vocab_size=64)
    base |= dict(position_embedding_type="rope", rotary_base=500000, seq_length=64)
    cfg = ModelConfig(**base, use_rope_scaling=True, rope_scaling_factor=8.0)
    cfg.validate()
    ours = RotaryEmbedding.for_config(cfg).inv_freq
    theirs = rotary_pos_embedding.RotaryEmbedding(
        kv_channels=64,
        rotary_percent=1.0,
        rotary_base=500000,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        use_cpu_initialization=True,
    ).inv_freq
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, RotaryEmbedding(64, 500000).inv_freq)  # it did scale
    # Llama 3.2's values, as transformers reads them from config.json
    scaling = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
    scaling |= dict(original_max_position_embeddings=8192)
    cfg = ModelConfig(
        **base,
        use_rope_scaling=True,
        rope_scaling_factor=32.0,
        rope_scaling_original_max_position_embeddings=8192,
    )
    hf = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert torch.allclose(RotaryEmbedding.for_config(cfg).inv_freq, hf_inv_freq, rtol=1e-6)
    # position interpolation
    cfg = ModelConfig(**base, rotary_seq_len_interpolation_factor=4)
    theirs = rotary_pos_embedding.RotaryEmbedding(
        kv_channels=64,
        rotary_percent=1.0,
        rotary_base=500000,
        seq_len_interpolation_factor=4,
        use_cpu_initialization=True,
    ).get_freqs_non_repeated(16)
    cos, _ = RotaryEmbedding.for_config(cfg)(torch.arange(16))
    assert torch.allclose(cos[:, 0, 0, :32], theirs.cos(), atol=1e-6)
    with pytest.raises(ConfigError, match="add --position-embedding-type rope"):
        ModelConfig(use_rope_scaling=True).validate()


def test_yarn_and_dynamic_rope_give_megatron_core_and_transformers_tables(monkeypatch):
    """YaRN (--position-embedding-type yarn, Megatron-LM's flags) against megatron-core's
    YarnRotaryEmbedding and transformers' "yarn" rope_type (frequencies and the attention
    factor on cos and sin); dynamic NTK (--rope-scaling-type dynamic) against transformers'
    "dynamic" at a length past max_position_embeddings, and unscaled below it."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.config.model import ModelConfig
    from engine.model.rope import RotaryEmbedding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding

    base = dict(num_layers=1, hidden_size=128, num_attention_heads=2, vocab_size=64)
    base |= dict(rotary_base=500000, seq_length=64)
    hf_shape = dict(hidden_size=128, num_attention_heads=2, max_position_embeddings=64)
    for mscale, mscale_all_dim in ((1.0, 0.0), (0.8, 0.5)):
        cfg = ModelConfig(
            **base,
            position_embedding_type="yarn",
            rotary_scaling_factor=16.0,
            yarn_original_max_position_embeddings=4096,
            mscale=mscale,
            mscale_all_dim=mscale_all_dim,
        )
        cfg.validate()
        cos, sin = RotaryEmbedding.for_config(cfg)(torch.arange(48))
        # megatron-core moves its tables to the current CUDA device: here, the CPU
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        theirs = yarn_rotary_pos_embedding.YarnRotaryEmbedding(
            kv_channels=64,
            rotary_base=500000,
            scaling_factor=16.0,
            original_max_position_embeddings=4096,
            mscale=mscale,
            mscale_all_dim=mscale_all_dim,
            use_cpu_initialization=True,
        )
        angles, concentration = theirs.get_emb(48)
        assert torch.allclose(cos, angles.cos() * concentration, atol=1e-6)
        assert torch.allclose(sin, angles.sin() * concentration, atol=1e-6)
        assert concentration > 1.0
        rope = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 16.0}
        rope |= {"original_max_position_embeddings": 4096}
        rope |= {"mscale": mscale, "mscale_all_dim": mscale_all_dim} if mscale_all_dim else {}
        hf = LlamaConfig(**hf_shape, rope_parameters=rope)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
        ours = RotaryEmbedding.for_config(cfg)
        assert torch.allclose(ours.inv_freq, inv_freq, rtol=1e-6)
        assert ours.attention_factor == pytest.approx(factor, rel=1e-12)
    cfg = ModelConfig(
        **base, position_embedding_type="rope", rope_scaling_type="dynamic", rope_scaling_factor=4.0
    )
    hf = LlamaConfig(
        **hf_shape, rope_parameters={"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 4.0}
    )
    ours = RotaryEmbedding.for_config(cfg)
    for length in (40, 64, 200):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, torch.device("cpu"), seq_len=length)
        expected = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        cos, _ = ours(torch.arange(length), length)
        assert torch.allclose(cos[:, 0, 0, :32], expected.cos(), atol=1e-6), length
    assert not torch.allclose(ours._dynamic_inv_freq(200), ours.inv_freq)  # it did scale
    with pytest.raises(ConfigError, match="--use-rope-scaling and --rope-scaling-type dynamic"):
        ModelConfig(**base, position_embedding_type="rope", use_rope_scaling=True,
                    rope_scaling_type="dynamic").validate()  # fmt: skip


def test_window_size_is_megatron_lm_left_right():
    """--window-size (left, right): itself and `left` tokens back; only causal windows."""
    from engine.config.model import ModelConfig

    assert ModelConfig(window_size="(4095, 0)").attention_window == 4095
    assert ModelConfig(window_size="7,0").attention_window == 7
    assert ModelConfig(window_size="(-1, 0)").attention_window is None
    with pytest.raises(ConfigError, match="only causal windows"):
        ModelConfig(window_size="(8, 8)").validate()
    with pytest.raises(ConfigError, match="give two integers"):
        ModelConfig(window_size="8").validate()
