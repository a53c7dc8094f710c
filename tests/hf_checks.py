"""Checks the Hugging Face families' tests share: a transformers model imported gives its logits
and exports back bit-identical; a model trained here a few steps, exported, gives transformers
the engine's logits and greedy tokens; an imported model's logits under TP2 x EP2 x PP2."""

from __future__ import annotations

import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.interop.hf.export import export_to_hf
from tests.distributed import rel_err
from tests.requirements import require


def trained_matches_transformers(dataset_prefix, tokenizer_model, tmp_path, flags, architecture):
    """Train 4 ranks with `flags`, export to tmp_path/hf, check transformers loads it as
    `architecture` with the engine's logits (within 1e-5) and 12 greedy tokens; returns the
    engine's model and config."""
    transformers = require("transformers")
    from engine.eval.generate import greedy_generate
    from engine.model import BuildContext, GPTModel
    from tests.test_training import base_args, pretrain

    ckpt = str(tmp_path / "ckpt")
    pretrain(4, base_args(dataset_prefix, tokenizer_model, **flags, **{"--save": ckpt}))
    export_to_hf(ckpt, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == architecture
    path = iteration_dir(ckpt, find_latest(ckpt))
    cfg = ModelConfig(**read_meta(path)["model"])
    ours = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, ours.eval())
    tokens = torch.randint(3, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.full_logits(ours(tokens=tokens))
        assert rel_err(hf(tokens).logits, expected) < 1e-5
    prompt = tokens[0, :6].tolist()
    hf.generation_config.eos_token_id = None  # no early stop: compare 12 tokens each
    theirs = hf.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=3
    )[0].tolist()
    assert greedy_generate(ours, prompt, 12) == theirs
    return ours, cfg


def imported_under_tp2_ep2_pp2(hf, tmp_path, tokens) -> None:
    """transformers' model `hf` (saved in tmp_path/hf), imported, gives its logits under
    TP2 x EP2 x PP2 (tp2_ep2_pp2_logits) within 1e-5."""
    from engine.interop.hf.import_hf import import_from_hf
    from tests.distributed import run_ranks

    ckpt = str(tmp_path / "ours")
    import_from_hf(str(tmp_path / "hf"), ckpt)
    with torch.no_grad():
        expected = hf(tokens).logits
    results = run_ranks(tp2_ep2_pp2_logits, 4, ckpt, tokens)
    for logits in results[2:]:  # the last pipeline stage
        assert rel_err(logits, expected) < 1e-5


def tp2_ep2_pp2_logits(rank, world, ckpt, tokens):
    """The last pipeline stage's full logits of checkpoint `ckpt`'s model under TP2 (SP) x
    EP2 (the experts whole: ETP 1) x PP2 on 4 ranks; None on the first stage."""
    from engine.model.builder import build_model_chunks
    from parallel.pipeline.p2p import P2P
    from parallel.state import ParallelState

    state = ParallelState.build(tp=2, pp=2, ep=2, etp=1)
    path = iteration_dir(ckpt, 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    (model,) = build_model_chunks(cfg, state, sequence_parallel=True)
    load_model_weights(path, model.eval())
    p2p = P2P(state, (tokens.shape[1] // 2, tokens.shape[0], cfg.hidden_size), torch.float32)
    with torch.no_grad():
        if state.is_first_stage:
            p2p.send_forward(model(tokens=tokens))
            return None
        return model.full_logits(model(hidden=p2p.recv_forward()))


def round_trip(hf, tmp_path, tokens, architecture: str) -> tuple[ModelConfig, dict, dict]:
    """Import transformers' model `hf` (saved in tmp_path/hf) to tmp_path/ours: the engine's
    logits are transformers' (within 1e-5); export it to tmp_path/again: the same tensors, and
    transformers' logits again. Returns (our config, config.json before, after)."""
    transformers = require("transformers")
    from engine.interop.hf.import_hf import import_from_hf
    from engine.model import BuildContext, GPTModel
    from tests.test_hf_moe import same_tensors

    summary = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert summary["architecture"] == architecture
    path = iteration_dir(str(tmp_path / "ours"), 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model.eval())
    with torch.no_grad():
        expected = hf(tokens).logits
        ours = model.full_logits(model(tokens=tokens))
    assert rel_err(ours, expected) < 1e-5
    export_to_hf(str(tmp_path / "ours"), str(tmp_path / "again"))
    before, after = same_tensors(tmp_path / "hf", tmp_path / "again")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert rel_err(reloaded(tokens).logits, expected) < 1e-6
    return cfg, before, after
