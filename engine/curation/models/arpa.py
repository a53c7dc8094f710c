"""A small bigram language model in the ARPA format KenLM reads, made from tokenised sentences,
and a folder laid out as CCNet's models are (write_ccnet_models): the reference models of the
tests and the benchmark of the KenLM perplexity stage. (Users bring CCNet's models, or KenLM's
own `lmplz` output; this is no replacement for its smoothing.)

Unigrams add-one smoothed; bigrams seen in the text absolutely discounted by `discount`, the
mass taken given back through the unigrams by the history's backoff weight.
"""

from __future__ import annotations

import math
import os
from collections import Counter

from engine.curation.models.kenlm_model import ccnet_normalize


def write_bigram_arpa(sentences: list[list[str]], path: str, discount: float = 0.5) -> None:
    unigrams: Counter = Counter()
    bigrams: Counter = Counter()
    for tokens in sentences:
        words = ["<s>", *tokens, "</s>"]
        unigrams.update(words[1:])
        bigrams.update(zip(words[:-1], words[1:], strict=False))
    vocabulary = sorted(set(unigrams) | {"<unk>"})
    total = sum(unigrams.values()) + len(vocabulary)
    unigram_p = {w: (unigrams[w] + 1) / total for w in vocabulary}
    followers: dict[str, list[str]] = {}
    for history, word in bigrams:
        followers.setdefault(history, []).append(word)
    history_count = Counter()
    for (history, _), count in bigrams.items():
        history_count[history] += count
    backoff = {}
    for history, words in followers.items():
        left = discount * len(words) / history_count[history]
        backoff[history] = left / (1.0 - sum(unigram_p[w] for w in words))
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"\\data\\\nngram 1={len(vocabulary) + 1}\nngram 2={len(bigrams)}\n\n\\1-grams:\n")
        f.write(f"-99\t<s>\t{math.log10(backoff.get('<s>', 1.0)):.7f}\n")
        for word in vocabulary:
            weight = f"\t{math.log10(backoff[word]):.7f}" if word in backoff else ""
            f.write(f"{math.log10(unigram_p[word]):.7f}\t{word}{weight}\n")
        f.write("\n\\2-grams:\n")
        for (history, word), count in sorted(bigrams.items()):
            p = (count - discount) / history_count[history]
            f.write(f"{math.log10(p):.7f}\t{history} {word}\n")
        f.write("\n\\end\\\n")


def write_ccnet_models(texts: list[str], folder: str, language: str = "en") -> None:
    """<language>.sp.model (a 600-piece unigram SentencePiece model) and <language>.arpa (a
    bigram model over its pieces), both trained on the texts normalised as CCNet's were."""
    import sentencepiece

    normalised = [ccnet_normalize(t) for t in texts]
    training = os.path.join(folder, f"{language}.train.txt")
    with open(training, "w", encoding="utf-8") as f:
        f.write("\n".join(normalised))
    sentencepiece.SentencePieceTrainer.train(
        input=training, model_prefix=os.path.join(folder, f"{language}.sp"), vocab_size=600,
        model_type="unigram", character_coverage=1.0, num_threads=1, minloglevel=2,
    )  # fmt: skip
    os.remove(training)
    pieces = sentencepiece.SentencePieceProcessor(
        model_file=os.path.join(folder, f"{language}.sp.model")
    )
    sentences = [pieces.encode(t, out_type=str) for t in normalised]
    write_bigram_arpa(sentences, os.path.join(folder, f"{language}.arpa"))
