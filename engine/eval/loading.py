"""A model and its tokenizer for evaluation, in one process: from our checkpoint (saved under
any layout) or from a Hugging Face folder (imported first, as tools/convert_checkpoint.py
--from-hf does). Inputs holding several documents are scored as the run trained on them: with
the run's --reset-position-ids / --reset-attention-mask (`recorded_packing`), within each."""

from __future__ import annotations

import os
import tempfile

import torch

from engine.checkpoint.files import find_latest, iteration_dir
from engine.config.tokenizer import TokenizerConfig, config_from_record
from engine.data.documents import Packing
from engine.data.tokenizers import Tokenizer, build_tokenizer
from engine.data.tokenizers.base import plain
from engine.errors import ConfigError, InputError


def checkpoint_folder(load: str, iteration: int | None = None) -> str:
    """The iteration folder of the checkpoint root `load` (the latest unless `iteration`)."""
    if iteration is None:
        iteration = find_latest(load)
        if iteration is None:
            raise InputError(
                f"{load}: no checkpoint here (no latest_checkpointed_iteration.txt); --load takes "
                "the folder training saved to, or a Hugging Face model folder"
            )
    path = iteration_dir(load, iteration)
    if not os.path.isdir(path):
        raise InputError(f"{path}: no such checkpoint iteration")
    return path


def load_model(load: str, iteration: int | None = None, tokenizer: TokenizerConfig | None = None):
    """(model in eval mode, tokenizer, its description) from `load`: our checkpoint root or a
    Hugging Face folder (config.json + safetensors). `tokenizer` overrides the recorded one."""
    if os.path.isfile(os.path.join(load, "config.json")):
        from engine.interop.hf.import_hf import import_from_hf

        with tempfile.TemporaryDirectory() as tmp:
            imported = os.path.join(tmp, "imported")
            import_from_hf(load, imported)
            return _from_checkpoint(checkpoint_folder(imported, 0), tokenizer, load)
    return _from_checkpoint(checkpoint_folder(load, iteration), tokenizer, load)


def _from_checkpoint(path: str, override: TokenizerConfig | None, shown: str):
    from engine.checkpoint.files import read_meta
    from engine.checkpoint.load import load_model_weights
    from engine.config.model import ModelConfig
    from engine.model import BuildContext, GPTModel

    meta = read_meta(path)
    cfg = ModelConfig.from_record(meta["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    model.eval()
    return model, _tokenizer(meta, override, path), f"{shown} (iteration {meta['iteration']})"


def recorded_packing(load: str, iteration: int | None = None) -> Packing | None:
    """What the run that saved `load` made of its samples' EOD tokens (--reset-position-ids,
    --reset-attention-mask, --eod-mask-loss), for evaluation to apply as training did; None
    for a run without them and for a Hugging Face folder."""
    from engine.checkpoint.files import read_meta

    if os.path.isfile(os.path.join(load, "config.json")):
        return None
    recorded = read_meta(checkpoint_folder(load, iteration)).get("packing")
    return Packing(**recorded) if recorded else None


def _tokenizer(meta: dict, override: TokenizerConfig | None, path: str) -> Tokenizer:
    cfg = override or config_from_record(meta)
    if cfg is None:
        raise ConfigError(
            f"{path}: the checkpoint records no tokenizer; name one with the tokenizer flags "
            "(--tokenizer-type, --tokenizer-model, ...)"
        )
    return build_tokenizer(cfg)


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer encoding text alone, without the BOS/EOS it may add (the harness encodes
    contexts and continuations so for causal models)."""
    return plain(tokenizer)


@torch.no_grad()
def _next_logprobs(model, ids: list[int], packing: Packing | None = None) -> torch.Tensor:
    """[len(ids) - 1, V] log-probabilities of the token after each of ids[:-1], in float64;
    with `packing`, the inputs' documents attend and count positions as in training."""
    tokens = torch.tensor([ids[:-1]], device=next(model.parameters()).device)
    batch = packing.annotate({"tokens": tokens}) if packing is not None else {}
    output = model(
        tokens=tokens,
        position_ids=batch.get("position_ids"),
        document_ids=batch.get("document_ids"),
    )
    logits = model.full_logits(output)[0].double()  # [s, V]
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(model, ids: list[int], packing: Packing | None = None) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1 .. len(ids) - 1, in float64 (within documents, with
    `packing`)."""
    logprobs = _next_logprobs(model, ids, packing)
    return logprobs.gather(1, torch.tensor(ids[1:], device=logprobs.device)[:, None])[:, 0]


def score_continuation(
    model,
    context_ids: list[int],
    continuation_ids: list[int],
    max_length: int,
    prefix_id,
    packing: Packing | None = None,
) -> tuple[float, bool]:
    """(summed log-probability of the continuation, whether greedy decoding gives it). As the
    harness does, the text is cut from the left to `max_length` inputs, and an empty context
    is `prefix_id`."""
    whole = ((context_ids or [prefix_id]) + continuation_ids)[-(max_length + 1) :]
    logprobs = _next_logprobs(model, whole, packing)[-len(continuation_ids) :]
    target = torch.tensor(continuation_ids, device=logprobs.device)
    picked = logprobs.gather(1, target[:, None])[:, 0]
    return float(picked.sum()), bool((logprobs.argmax(dim=-1) == target).all())


def loglikelihood_of(model, max_length: int, prefix_id: int | None, packing: Packing | None = None):
    """f(context ids, continuation ids) -> summed log-probability of the continuation. As the
    harness does, the text is cut from the left to `max_length` inputs, and an empty context
    is `prefix_id` (the tokenizer's BOS, else its end-of-document token)."""

    def loglikelihood(context_ids: list[int], continuation_ids: list[int]) -> float:
        if not continuation_ids:
            return 0.0
        if len(continuation_ids) > max_length:
            raise InputError(
                f"a choice of {len(continuation_ids)} tokens is longer than the longest input "
                f"({max_length}); raise --seq-length or shorten the task's choices"
            )
        if not context_ids and prefix_id is None:
            raise ConfigError("an empty context needs a tokenizer with a BOS or EOD id")
        return score_continuation(
            model, context_ids, continuation_ids, max_length, prefix_id, packing
        )[0]

    return loglikelihood


def untrained_like(model, seed: int):
    """The same model freshly initialised from `seed`, as training would start it (a baseline
    to read scores against)."""
    from engine.model import BuildContext, GPTModel

    torch.manual_seed(seed)
    fresh = GPTModel(model.config, BuildContext(model.config))
    return fresh.eval()
