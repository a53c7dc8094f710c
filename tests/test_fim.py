"""Fill-in-the-middle samples (engine/data/fim.py): every rearranged document is the original
text cut in three and written in PSM or SPM order, at the rates asked; fragments, the
no-prefix rule, lengths and padding; each sample drawn by its index (the same whatever reads
it); and a run trains on them. (Megatron-LM's own transformation is not in the megatron-core
package: tools/megatron_fim_check.py compares the two from a Megatron-LM checkout; see
docs/packing.md for its result.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config.fim import FimConfig
from engine.data.builder import build_gpt_datasets
from engine.data.fim import FimSamples, FimTransform
from engine.data.sources import data_sources
from engine.data.tokenizers.sentencepiece import SentencePieceTokenizer

FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|file|>"]
SEQ = 128


@pytest.fixture(scope="module")
def fim_data(corpus, tmp_path_factory):
    """A SentencePiece tokenizer given the FIM tokens (and a file separator) when trained, and
    short documents of two 'files' each, preprocessed with it: (tokenizer path, prefix)."""
    from engine.data.prepare.preprocess import preprocess
    from engine.data.tokenizers.train_sentencepiece import train_tokenizer

    folder = tmp_path_factory.mktemp("fim")
    train_tokenizer([corpus["jsonl"]], str(folder / "tok"), 1000, user_defined_symbols=FIM_TOKENS)
    with open(corpus["jsonl"]) as source, open(folder / "short.jsonl", "w") as out:
        for k, line in enumerate(source):
            lines = [x for x in json.loads(line)["text"].splitlines() if x.strip()]
            for s in range(0, min(len(lines), 60), 6):
                text = "\n".join(lines[s : s + 3]) + "<|file|>" + "\n".join(lines[s + 3 : s + 6])
                out.write(json.dumps({"text": text}) + "\n")
            if k > 30:
                break
    model = str(folder / "tok.model")
    preprocess(str(folder / "short.jsonl"), str(folder / "data"), model, append_eod=True)
    return model, str(folder / "data_text_document")


def _samples(prefix: str, count: int = 60):
    train = build_gpt_datasets(data_sources([prefix], "100,0,0"), SEQ, 1, (count, 0, 0))[0]
    return [np.asarray(train[i], dtype=np.int64) for i in range(count)]


def _transform(model: str, **flags) -> FimTransform:
    cfg = FimConfig(fim_data=True, fim_eod_token="</s>", **flags)
    return FimTransform(cfg, SentencePieceTokenizer(model), seed=5)


def _documents(ids: np.ndarray, eod: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(ids == eod)
    return list(np.split(ids, cuts + 1))


@pytest.mark.parametrize("spm", [0.0, 1.0])
def test_every_document_is_its_text_cut_in_three_in_psm_or_spm_order(fim_data, spm):
    model, prefix = fim_data
    transform = _transform(model, fim_rate=1.0, fim_spm_rate=spm)
    t, text = transform.tokens, transform.tokenizer
    checked = 0
    for index, sample in enumerate(_samples(prefix)):
        out = transform(sample, index)
        assert out.shape == sample.shape and out.dtype == np.int64
        originals = [d[d != t.eod] for d in _documents(sample, t.eod)]
        originals = [d for d in originals[:-1] if len(d)] + originals[-1:]
        rearranged = [d[d != t.eod] for d in _documents(out, t.eod)]
        for original, got in list(zip(originals, rearranged, strict=False))[:-1]:
            assert got[0] == t.prefix  # every document rearranged at rate 1
            if spm:  # <pre> <suf> suffix <mid> prefix middle
                assert got[1] == t.suffix
                suffix, rest = np.split(got[2:], [list(got[2:]).index(t.middle)])
                pieces = (rest[1:], suffix)
            else:  # <pre> prefix <suf> suffix <mid> middle
                p_end, m_at = list(got).index(t.suffix), list(got).index(t.middle)
                pieces = (np.concatenate([got[1:p_end], got[m_at + 1 :]]), got[p_end + 1 : m_at])
            recomposed = text.detokenize(pieces[0]) + text.detokenize(pieces[1])
            assert recomposed == text.detokenize(original)
            checked += 1
    assert checked > 60


def test_rates_no_prefix_and_padding(fim_data):
    model, prefix = fim_data
    samples = _samples(prefix)
    none = _transform(model, fim_rate=0.0)
    t = none.tokens
    for i, s in enumerate(samples):  # unchanged but for empty documents, as Megatron-LM's:
        empty = (s == t.eod) & (np.roll(s, 1) == t.eod)  # an EOD after an EOD ...
        empty[0] = s[0] == t.eod  # ... or at the start, dropped; the sample padded
        kept = s[~empty]
        expected = np.concatenate([kept, np.full(len(s) - len(kept), t.pad)])
        assert np.array_equal(none(s, i), expected)
    half = _transform(model, fim_rate=0.5)
    documents = rearranged = 0
    for i, s in enumerate(samples):
        out = half(s, i)
        documents += int((s == t.eod).sum()) + 1
        rearranged += int((out == t.prefix).sum())
    assert 0.35 < rearranged / documents < 0.65, (rearranged, documents)
    # documents starting with the no-prefix text stay as they are: here every first line
    first = half.tokenizer.detokenize(samples[0][:3])
    kept = _transform(model, fim_rate=1.0, fim_no_prefix=first)
    out = kept(samples[0], 0)
    assert np.array_equal(out[:3], samples[0][:3])
    # a sample grown shorter (empty documents between EODs vanish) is padded with <fim_pad>
    sample = samples[0].copy()
    sample[5:9] = t.eod
    out = _transform(model, fim_rate=0.0)(sample, 0)
    assert (out[-2:] == t.pad).all() and len(out) == len(sample)


def test_fragments_are_rearranged_apart_and_keep_their_separator(fim_data):
    model, prefix = fim_data
    transform = _transform(
        model, fim_rate=1.0, fim_spm_rate=0.0, fim_split_sample="<|file|>", fim_fragment_rate=1.0
    )
    t = transform.tokens
    for i, sample in enumerate(_samples(prefix, 20)):
        out = transform(sample, i)
        for original, got in zip(
            _documents(sample, t.eod)[:-1], _documents(out, t.eod)[:-1], strict=False
        ):
            files = int((original == t.split).sum())
            assert int((got == t.split).sum()) == files
            assert int((got == t.prefix).sum()) == files + 1  # each fragment on its own


def test_each_sample_is_drawn_by_its_index(fim_data):
    """Read in any order (data-parallel ranks, a resumed run, workers), sample i is the same."""
    model, prefix = fim_data
    train = build_gpt_datasets(data_sources([prefix], "100,0,0"), SEQ, 1, (40, 0, 0))[0]
    transform = _transform(model)
    forward = [FimSamples(train, transform)[i] for i in range(40)]
    backward = [FimSamples(train, transform)[i] for i in reversed(range(40))][::-1]
    assert all(np.array_equal(a, b) for a, b in zip(forward, backward, strict=True))
    other_seed = FimTransform(transform.cfg, SentencePieceTokenizer(model), seed=6)
    assert any(not np.array_equal(FimSamples(train, other_seed)[i], forward[i]) for i in range(40))


def test_a_run_trains_on_fim_samples(fim_data, tmp_path):
    from tests.distributed import run_ranks
    from tests.test_packed_documents import _pretrain
    from tests.test_training import base_args, losses

    model, prefix = fim_data
    log = str(tmp_path / "log.jsonl")
    flags = {"--fim-data": True, "--fim-eod-token": "</s>", "--fim-rate": "0.9"}
    flags |= {"--train-iters": "3", "--seq-length": str(SEQ), "--log-jsonl": log}
    run_ranks(_pretrain, 2, base_args(prefix, model, **flags), timeout=300)
    found = losses(log)
    assert sorted(found) == [1, 2, 3] and all(np.isfinite(v) for v in found.values())
