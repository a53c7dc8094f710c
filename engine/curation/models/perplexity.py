"""Scoring documents by their perplexity under a reference language model, as CCNet did, to
keep a band of them: CCNet's head (the most fluent), middle and tail buckets.

The reference model is a model trained by tripod on trusted text (its checkpoint folder) or
any Hugging Face causal LM folder (config.json + safetensors, imported as
tools/convert_checkpoint.py --from-hf imports it: loading runs no code). A document's
perplexity is exp of the mean negative log-likelihood of its first `max_tokens` tokens, each
predicted from those before it (the first from the tokenizer's BOS, else its end-of-document
token), written to the document as the field `perplexity`.

Documents are scored after the deduplication, those it keeps, with their duplicate lines
dropped (CCNet scored what its deduplication left). Buckets, as CCNet: `head` below the
cutoff at the 30th percentile, `middle` below the 60th, `tail` the rest; the cutoffs are
given (`cutoffs: [head's upper, middle's upper]`, for a run keeping one language) or computed
per language (the documents' `language` field, "all" without one) over a sample of `sample`
documents of each (all of them when fewer; CCNet computed its cutoffs over a sample too).
Documents in a bucket not in `keep` are removed (`perplexity:<bucket>`); every scored
document gets the fields `perplexity` and `perplexity_bucket`.

A Hugging Face folder is imported once per run into <output>/work/reference-model/, and the
checkpoint's iteration is fixed when the run starts, so every task scores with the same model.

Or, with `kenlm: <folder>` instead of `model`, CCNet's own KenLM models, one per language
(kenlm_model.py): each document scored by its language's model (`default_language` for a
document without a `language` field).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass

import numpy as np

from engine.curation.atomic import save_json
from engine.errors import ConfigError

BUCKETS = ("head", "middle", "tail")


@dataclass(frozen=True)
class Perplexity:
    model: str = ""  # a tripod checkpoint folder or a Hugging Face causal LM folder
    kenlm: str = ""  # or a folder of CCNet's KenLM models (<lang>.arpa.bin + <lang>.sp.model)
    default_language: str = "en"  # KenLM: the model of a document without a language field
    keep: tuple = ("head", "middle")  # CCNet's buckets kept
    percentiles: tuple = (30.0, 60.0)  # CCNet's head and middle upper percentiles
    cutoffs: tuple = ()  # fixed (head's upper, middle's upper) perplexities; (): computed
    sample: int = 100_000  # documents per language the computed cutoffs are taken over
    max_tokens: int = 1024  # tokens of a document scored (its start)
    threads: int = 1  # torch threads per worker

    def __post_init__(self):
        unknown = [b for b in self.keep if b not in BUCKETS]
        if unknown or not self.keep:
            raise ValueError(f"keep {list(self.keep)}: give some of {', '.join(BUCKETS)}")
        for name, pair in (("percentiles", self.percentiles), ("cutoffs", self.cutoffs)):
            if name == "cutoffs" and not pair:
                continue
            if len(pair) != 2 or not all(isinstance(x, int | float) for x in pair):
                raise ValueError(f"{name} {list(pair)}: give two numbers, the lower first")
            if not pair[0] <= pair[1]:
                raise ValueError(f"{name} {list(pair)}: give the lower first")
        if not (self.percentiles[0] >= 0 and self.percentiles[1] <= 100):
            raise ValueError(f"percentiles {list(self.percentiles)}: give them within 0..100")
        if self.max_tokens < 1 or self.threads < 1 or self.sample < 1:
            raise ValueError("max_tokens, threads and sample: give at least 1")

    def check(self, where: str) -> None:
        """The model is a Hugging Face folder or a checkpoint folder holding an iteration (a
        KenLM folder is checked against the languages kept: check_languages)."""
        from engine.checkpoint.files import find_latest

        if bool(self.model) == bool(self.kenlm):
            given = "with both model and kenlm" if self.model else "without a model"
            raise ConfigError(
                f"{where}: on {given}; give one reference: model (a tripod checkpoint folder or "
                "a Hugging Face causal LM folder) or kenlm (a folder of CCNet's KenLM models)"
            )
        if self.kenlm:
            return
        if not os.path.isdir(self.model):
            raise ConfigError(f"{where}: model {self.model} is not a folder; give a checkpoint")
        if not is_hf_folder(self.model) and find_latest(self.model) is None:
            raise ConfigError(
                f"{where}: model {self.model} holds no checkpoint (no config.json, no "
                "latest_checkpointed_iteration.txt); give a --save folder or a Hugging Face folder"
            )

    def check_languages(self, languages: tuple[str, ...], where: str) -> None:
        if self.kenlm:
            from engine.curation.models.kenlm_model import check_folder

            check_folder(self.kenlm, languages, where)


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def prepare_reference(params: Perplexity, work: str) -> str:
    """The reference model every task of the run loads, fixed once (a Hugging Face folder
    imported into work/reference-model/, a checkpoint's latest iteration): a JSON file's path
    with {"folder", "iteration"}."""
    from engine.checkpoint.files import find_latest

    path = os.path.join(work, "reference-model.json")
    if os.path.exists(path):
        return path
    if params.kenlm:
        reference = {"kenlm": params.kenlm}
    elif is_hf_folder(params.model):
        from engine.interop.hf.import_hf import import_from_hf

        folder = os.path.join(work, "reference-model")
        shutil.rmtree(folder, ignore_errors=True)
        import_from_hf(params.model, folder)
        reference = {"folder": folder, "iteration": 0}
    else:
        reference = {"folder": params.model, "iteration": find_latest(params.model)}
    save_json(path, reference)
    return path


def scorer_for(params: Perplexity, reference: dict):
    """The scorer of prepare_reference's record: `score(text, language)` -> perplexity."""
    if "kenlm" in reference:
        from engine.curation.models.kenlm_model import KenlmScorer

        return KenlmScorer(reference["kenlm"])
    return PerplexityScorer(params, reference["folder"], reference["iteration"])


class PerplexityScorer:
    """`score(text, language)` -> the document's perplexity under the reference model (a
    checkpoint folder and iteration; loaded once per shard, on the CPU; one model for every
    language)."""

    def __init__(self, params: Perplexity, folder: str, iteration: int):
        import torch

        from engine.eval.loading import load_model, plain_tokenizer

        torch.set_num_threads(params.threads)
        self.model, tokenizer, _ = load_model(folder, iteration)
        self.tokenizer = plain_tokenizer(tokenizer)
        self.prefix = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
        # the prefix takes one position
        self.length = min(params.max_tokens, self.model.config.max_positions - 1)

    def score(self, text: str, language: str = "") -> float:
        from engine.eval.loading import token_logprobs

        ids = self.tokenizer.tokenize(text)[: self.length]
        if not ids:
            return math.inf
        logprobs = token_logprobs(self.model, [self.prefix, *ids])
        return math.exp(min(-float(logprobs.mean()), 700.0))


def cutoffs_of(scores: np.ndarray, params: Perplexity) -> tuple[float, float]:
    """The (head, middle) upper perplexities: given, or the percentiles of `scores`."""
    if params.cutoffs:
        return float(params.cutoffs[0]), float(params.cutoffs[1])
    finite = scores[np.isfinite(scores)]
    if not len(finite):
        return math.inf, math.inf
    low, high = np.percentile(finite, params.percentiles)
    return float(low), float(high)


def buckets_of(scores: np.ndarray, cutoffs: tuple[float, float]) -> np.ndarray:
    """Each score's bucket: 0 head (below the first cutoff), 1 middle, 2 tail."""
    return np.where(scores < cutoffs[0], 0, np.where(scores < cutoffs[1], 1, 2)).astype(np.int8)
