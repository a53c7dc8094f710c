"""Megatron-LM torch_dist checkpoints into ours: megatron-core 0.16.1 builds GPT models (its
local layer spec, no TransformerEngine) on CPU gloo ranks, saves them with its own
dist_checkpointing under TP 2 and PP 2, and loads them back at TP 1 to compute its own
logits; tools/convert_checkpoint.py --from-megatron converts the same folder, and our model's
logits from the converted checkpoint must equal megatron-core's.

megatron-core asks CUDA for a few things at run time even on CPU; each rank replaces exactly
these, and nothing else, before building the model (tools/megatron_cpu.py:cuda_queries_on_cpu:
the current device, synchronize, the CUDA RNG state). The causal mask is passed in, since its
default is made on "cuda". common.pt holds Megatron-LM's
arguments (an argparse.Namespace) and the iteration, as megatron.training saves them
(megatron.training itself is not installed)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

import pytest
import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.errors import InputError
from engine.model import BuildContext, GPTModel
from tests.cli import run_forked, run_python
from tests.distributed import rel_err, run_ranks
from tests.test_training import ROOT
from tools import megatron_cpu
from tools.megatron_cpu import cuda_queries_on_cpu

SEQ, VOCAB = 16, 64
STYLES = {
    "llama": dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        ffn_hidden_size=48,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        rotary_base=500,
        untie_embeddings_and_output_weights=True,
        qk_layernorm=False,
    ),
    "gpt": dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        group_query_attention=False,
        num_query_groups=None,
        ffn_hidden_size=64,
        swiglu=False,
        # their megatron-core model below runs the exact GELU (bias_activation_fusion off)
        bias_gelu_fusion=False,
        normalization="LayerNorm",
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        untie_embeddings_and_output_weights=False,
        qk_layernorm=False,
    ),
}
# GPT-2 style with per-head LayerNorm on queries and keys (weights and biases).
STYLES["gpt-qkln"] = dict(STYLES["gpt"], qk_layernorm=True)
# Llama style with biases on q, k, v only (Qwen2) and Llama 3.x RoPE scaling; a base large
# enough that the scaling changes some frequencies and leaves others.
STYLES["qwen2-scaled"] = dict(
    STYLES["llama"],
    add_qkv_bias=True,
    use_rope_scaling=True,
    rope_scaling_factor=8.0,
    rotary_base=500000,
)


# megatron-core's TransformerConfig on the CPU in fp32, weights large enough (std 0.2) that
# every one shows in the logits
CPU_CONFIG = dict(megatron_cpu.CPU_CONFIG, pipeline_dtype=torch.float32, init_method_std=0.2)


def _megatron_model(style: str, tp: int, pp: int, vocab: int = VOCAB):
    warnings.simplefilter("ignore")
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda_queries_on_cpu()
    parallel_state.initialize_model_parallel(tp, pp)
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    s = STYLES[style]
    config = TransformerConfig(
        num_layers=s["num_layers"],
        hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"],
        num_query_groups=s["num_query_groups"],
        ffn_hidden_size=s["ffn_hidden_size"],
        gated_linear_unit=s["swiglu"],
        activation_func=F.silu if s["swiglu"] else F.gelu,
        normalization=s["normalization"],
        add_bias_linear=s["add_bias_linear"],
        add_qkv_bias=s.get("add_qkv_bias", False),
        **CPU_CONFIG,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    return MegatronGPT(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization=s["normalization"], qk_layernorm=s["qk_layernorm"]
        ),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        position_embedding_type=s["position_embedding_type"],
        rotary_base=s["rotary_base"],
        rope_scaling=s.get("use_rope_scaling", False),
        rope_scaling_factor=s.get("rope_scaling_factor", 8.0),
        share_embeddings_and_output_weights=not s["untie_embeddings_and_output_weights"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def _args(style: str) -> argparse.Namespace:
    """Megatron-LM's arguments as its training saves them in common.pt: the fields read, and
    the megatron-core objects every real run's arguments hold (its enums, --exit-signal)."""
    import signal

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    s = STYLES[style]
    return argparse.Namespace(
        **s,
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        exit_signal=signal.SIGTERM,
        kv_channels=s["hidden_size"] // s["num_attention_heads"],
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        padded_vocab_size=VOCAB,
        rotary_percent=1.0,
        norm_epsilon=1e-5,
        apply_layernorm_1p=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        consumed_train_samples=56,
        make_vocab_size_divisible_by=128,
        tokenizer_type="GPT2BPETokenizer",
    )


def _save(rank, world, style, tp, pp, path, common_inside=False):
    """common_inside: the common state as newer megatron-core keeps it, the sharded object
    `common_state` inside the checkpoint (Megatron-LM's HEAD does that in
    dist_checkpointing.save; 0.16.1's own ShardedObject writes it here). The test removes the
    common.pt 0.16.1 still writes, after 0.16.1's own load (which needs it) is done."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject

    torch.manual_seed(100 + rank)
    model = _megatron_model(style, tp, pp)
    with torch.no_grad():  # biases start at 0 and norms at 1: move them, so they count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    state = model.sharded_state_dict()
    common = {"args": _args(style), "iteration": 7, "checkpoint_version": 3.0}
    common["opt_param_scheduler"] = {"num_steps": 56}
    if common_inside:
        state["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
    else:
        state.update(common)
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)


def _megatron_logits(rank, world, style, path, tokens):
    from megatron.core import dist_checkpointing

    model = _megatron_model(style, 1, 1)
    state = model.sharded_state_dict()
    model.load_state_dict(dist_checkpointing.load(state, path), strict=False)
    return megatron_forward(model, tokens)


def megatron_forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """A megatron-core GPT model's logits of `tokens` [b, SEQ] (causal, in evaluation)."""
    model.eval()
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    positions = torch.arange(SEQ)[None].expand(tokens.shape[0], SEQ)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask)


def _convert(source: str, output: str, extra=()) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py --from-megatron, forked (its command line itself runs in
    test_load_resumes_a_megatron_checkpoint_where_it_stopped)."""
    return run_forked(
        "tools.convert_checkpoint", "--from-megatron", source, "--output", output, *extra
    )


@pytest.mark.parametrize(
    "style, tp, pp, inside",
    [
        ("llama", 2, 1, False),
        ("llama", 1, 2, True),
        ("gpt", 2, 1, False),
        ("gpt-qkln", 2, 1, True),
        ("qwen2-scaled", 2, 1, False),
    ],
)
def test_a_megatron_core_checkpoint_converts_to_the_same_logits(style, tp, pp, inside, tmp_path):
    """inside: the common state inside the checkpoint (no common.pt), as newer Megatron-LM."""
    root = tmp_path / "megatron"
    folder = str(root / "iter_0000007")
    run_ranks(_save, tp * pp, style, tp, pp, folder, inside)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    assert sorted(os.listdir(folder))[:2] == [".metadata", "__0_0.distcp"]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    [theirs] = run_ranks(_megatron_logits, 1, style, folder, tokens)
    if inside:
        os.remove(os.path.join(folder, "common.pt"))  # as Megatron-LM's HEAD: none at all

    ours_root = str(tmp_path / "ours")
    result = _convert(str(root), ours_root)
    assert result.returncode == 0, result.stderr
    path = iteration_dir(ours_root, find_latest(ours_root))
    meta = read_meta(path)
    assert (meta["iteration"], meta["consumed_samples"]) == (7, 56)
    assert meta["scheduler"] == {"num_steps": 7, "num_samples": 56}
    cfg = ModelConfig(**meta["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    with torch.no_grad():
        ours = model.full_logits(model.eval()(tokens=tokens))
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert rel_err(ours, theirs) < 1e-5
    assert meta["dtype"] == "float32"
    if inside:
        # back to Megatron-LM: what its load compares with the run's flags is what it saved
        back = tmp_path / "back"
        result = subprocess.run(
            [sys.executable, "tools/convert_checkpoint.py", "--to-megatron", "--load", ours_root]
            + ["--output", str(back)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        saved = torch.load(back / "iter_0000007" / "common.pt", weights_only=False)["args"]
        assert saved.make_vocab_size_divisible_by == 128
        assert saved.tokenizer_type == "GPT2BPETokenizer"


def test_common_pt_is_read_without_running_code(tmp_path):
    """A common.pt naming anything but argparse.Namespace is refused in one line, before
    anything is unpickled."""
    from engine.interop.megatron.common import read_common

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    torch.save({"args": argparse.Namespace(num_layers=2), "evil": Payload()}, folder / "common.pt")
    with pytest.raises(InputError, match="refers to .*system.*refusing to load it") as err:
        read_common(str(folder))
    assert "\n" not in str(err.value) and not (tmp_path / "ran").exists()
    torch.save({"args": argparse.Namespace(num_layers=2), "iteration": 3}, folder / "common.pt")
    assert read_common(str(folder))["iteration"] == 3


def test_load_resumes_a_megatron_checkpoint_where_it_stopped(tmp_path):
    """--load of Megatron-LM's checkpoint folder itself (as its scripts pass --save and --load
    the same folder), under another layout (saved TP 2, resumed PP 2): the weights are the
    converted ones, training goes on from iteration 8 at 56 samples consumed with the learning
    rate after 56 samples, and Megatron-LM's own folder is left as it was."""
    from engine.optim.lr_schedule import LRScheduler
    from engine.pretrain import parse
    from tests.harness import engine_steps
    from tests.test_training import records

    root = tmp_path / "megatron"
    folder = str(root / "iter_0000007")
    run_ranks(_save, 2, "llama", 2, 1, folder)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    before = {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}
    result = run_python(
        "tools/convert_checkpoint.py", "--from-megatron", str(root), "--output",
        str(tmp_path / "ours"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    path = iteration_dir(str(tmp_path / "ours"), 7)
    cfg = ModelConfig(**read_meta(path)["model"])
    converted = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, converted)

    load = ["--load", str(root), "--use-checkpoint-args", "--seq-length", str(SEQ)]
    [(loaded, _, _, _)] = run_ranks(engine_steps, 1, load)
    for name, value in converted.named_parameters():
        assert torch.equal(loaded[name], value.detach()), name

    log = str(tmp_path / "log.jsonl")
    flags = [
        *load, "--save", str(root), "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "9", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--eval-iters", "1", "--num-workers", "0", "--log-jsonl", log,
        "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--max-position-embeddings", str(SEQ),
    ]  # fmt: skip
    from tests.test_training import pretrain

    assert pretrain(2, flags) == [0, 0]
    found = [r for r in records(log) if "split" not in r]
    assert [(r["iteration"], r["consumed_samples"]) for r in found] == [(8, 64), (9, 72)]
    scheduler = LRScheduler(parse(flags).optimizer, 9, 8)
    assert found[0]["lr"] == scheduler.lr_after(56)
    assert {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)} == before
    assert find_latest(str(root)) == 9


@pytest.mark.parametrize(
    "change, says",
    [
        ({"position_embedding_type": "mrope"}, "--position-embedding-type mrope"),
        (
            {"apply_residual_connection_post_layernorm": True},
            "--apply-residual-connection-post-layernorm",
        ),
    ],
)
def test_saved_models_this_engine_cannot_build_are_refused(change, says):
    """A model the saved arguments describe but this engine would build differently is named in
    one line rather than loaded as something else; --openai-gelu, --squared-relu and
    --rotary-interleaved are kept."""
    from engine.interop.megatron.layout import model_config_from_args

    args = argparse.Namespace(**{**vars(_plain_args("llama")), **change})
    with pytest.raises(InputError, match=says):
        model_config_from_args(args)
    gelu = argparse.Namespace(**{**vars(_plain_args("gpt")), "openai_gelu": True})
    assert model_config_from_args(gelu).openai_gelu
    fused = argparse.Namespace(**{**vars(_plain_args("gpt")), "bias_gelu_fusion": True})
    assert model_config_from_args(fused).gelu_tanh  # Megatron-LM's default: the tanh GELU
    assert not model_config_from_args(_plain_args("gpt")).gelu_tanh
    kept = {"squared_relu": True, "rotary_interleaved": True}  # built here now, so carried
    config = model_config_from_args(argparse.Namespace(**{**vars(_plain_args("llama")), **kept}))
    assert config.squared_relu and config.rotary_interleaved


def _plain_args(style: str) -> argparse.Namespace:
    s = STYLES[style]
    return argparse.Namespace(
        **s, kv_channels=8, seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB
    )
