"""Our checkpoints -> Megatron-LM torch_dist checkpoints (tools/convert_checkpoint.py
--to-megatron), read by megatron-core 0.16.1 itself on CPU gloo ranks (the rig and its CUDA
stand-ins are those of tests/test_megatron_checkpoint.py): its dist_checkpointing.load finds
every tensor and object its GPT model asks for, its logits equal ours, and what it loads under
TP 2 x PP 2 (TP 2 for the tied GPT-style model) and saves again converts back to our tensors
bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.interop.megatron.checkpoint import megatron_progress
from engine.interop.megatron.common import read_common
from engine.model import BuildContext, GPTModel
from tests.cli import run_forked
from tests.distributed import rel_err, run_ranks
from tests.test_hf import _model_tensors
from tests.test_megatron_checkpoint import SEQ, STYLES, _args, _convert, _megatron_model
from tests.test_training import ROOT, pretrain

VOCAB = 60  # NullTokenizer's ids; padded to 64 by --make-vocab-size-divisible-by 16 (x TP 2)
STYLE_FLAGS = {
    "llama": [
        "--num-layers", "4", "--group-query-attention", "--num-query-groups", "2",
        "--ffn-hidden-size", "48", "--swiglu", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "500",
        "--untie-embeddings-and-output-weights",
    ],
    # the exact GELU of their megatron-core model (bias_activation_fusion off)
    "gpt": ["--num-layers", "2", "--ffn-hidden-size", "64", "--no-bias-gelu-fusion"],
}  # fmt: skip


def _train(style: str, save: str) -> None:
    flags = [
        *STYLE_FLAGS[style], "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "16", "--init-method-std", "0.2",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
        "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--tensor-model-parallel-size", "2", "--save", save,
    ]  # fmt: skip
    assert pretrain(2, flags) == [0, 0]


def _to_megatron(load: str, output: str, *extra: str) -> subprocess.CompletedProcess:
    return run_forked(
        "tools.convert_checkpoint", "--load", load, "--to-megatron", "--output", output, *extra
    )


def _load(style: str, tp: int, pp: int, vocab: int, path: str):
    """megatron-core's model under TP x PP, loaded from `path`; every key it asks for must be
    in the checkpoint (StrictHandling.RAISE_UNEXPECTED)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = _megatron_model(style, tp, pp, vocab)
    state = model.sharded_state_dict()
    loaded = dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_UNEXPECTED)
    missing, _ = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    return model, loaded


def _megatron_logits(rank, world, style, vocab, path, tokens):
    model, loaded = _load(style, 1, 1, vocab, path)
    model.eval()
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    positions = torch.arange(SEQ)[None].expand(tokens.shape[0], SEQ)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask), loaded["args"], loaded["iteration"]


def _reload_and_save(rank, world, style, tp, pp, vocab, path, again):
    from megatron.core import dist_checkpointing

    model, loaded = _load(style, tp, pp, vocab, path)
    state = model.sharded_state_dict()
    state.update({"args": loaded["args"], "iteration": loaded["iteration"]})
    os.makedirs(again, exist_ok=True)
    dist_checkpointing.save(state, again)


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_megatron_core_loads_our_checkpoint(style, tmp_path):
    ours = str(tmp_path / "ours")
    _train(style, ours)
    out = str(tmp_path / "megatron")
    result = _to_megatron(ours, out, "--tensor-model-parallel-size", "2")
    assert result.returncode == 0, result.stderr
    assert "--no-load-optim --no-load-rng" in result.stdout
    folder = os.path.join(out, "iter_0000003")
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "3"
    meta = read_meta(iteration_dir(ours, 3))
    cfg = ModelConfig(**meta["model"])
    padded = cfg.padded_vocab_size(2)
    assert padded == 64 and cfg.vocab_size < padded

    # megatron-core's own forward on the converted weights gives our logits
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    [(theirs, args, iteration)] = run_ranks(_megatron_logits, 1, style, padded, folder, tokens)
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(iteration_dir(ours, 3), model)
    with torch.no_grad():
        logits = model.full_logits(model.eval()(tokens=tokens))
    real = cfg.vocab_size
    assert rel_err(logits[..., :real], theirs[..., :real]) < 1e-5
    assert iteration == 3 and args.padded_vocab_size == padded
    expected = _args(style)
    for name in STYLES[style]:
        assert getattr(args, name) == getattr(expected, name), name
    progress = megatron_progress(folder)
    assert (progress["iteration"], progress["consumed_samples"]) == (3, 12)
    assert read_common(folder)["checkpoint_version"] == 3.0

    # loaded by megatron-core under TP 2 x PP 2 and saved again, it converts back bit for bit
    # (the tied GPT-style model under TP 2 alone: megatron-core ties the copies of its
    # embedding across pipeline stages on CUDA only)
    tp, pp = (2, 2) if style == "llama" else (2, 1)
    again = str(tmp_path / "again" / "iter_0000003")
    run_ranks(_reload_and_save, tp * pp, style, tp, pp, padded, folder, again)
    (tmp_path / "again" / "latest_checkpointed_iteration.txt").write_text("3")
    back = str(tmp_path / "back")
    assert _convert(str(tmp_path / "again"), back).returncode == 0
    original = _model_tensors(iteration_dir(ours, 3))
    returned = _model_tensors(iteration_dir(back, 3))
    assert original.keys() == returned.keys()
    for key, value in original.items():
        assert torch.equal(returned[key][: value.shape[0]], value), key


def test_to_megatron_refuses_an_existing_output_and_needs_load(tmp_path):
    out = tmp_path / "megatron"
    out.mkdir()
    (out / "keep").write_text("x")
    result = _to_megatron(str(tmp_path / "none"), str(out))
    assert result.returncode == 2 and "already exists" in result.stderr
    assert (out / "keep").read_text() == "x"
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "--to-megatron", "--output", "x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 2 and "give --load" in result.stderr


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0"),
        (["--pipeline-model-parallel-size", "-2"], "--pipeline-model-parallel-size -2"),
        (["--dtype", "bfloat16"], "drop --dtype"),
        (["--pipeline-model-parallel-size", "2"], "drop --dtype"),
        (["--no-load-optim"], "--no-load-optim applies to --from-megatron only"),
    ],
)
def test_converter_flags_that_cannot_apply_are_one_line(flags, says, tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "--to-megatron", "--load", "x"]
        + ["--output", str(tmp_path / "out"), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    [line] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line.startswith("error: ") and says in line, line
    assert not (tmp_path / "out").exists()
