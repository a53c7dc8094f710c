"""The perplexity stage under CCNet's KenLM models (kenlm: <folder>): a document's perplexity is
the one CCNet's own code gives (cc_net 1.0.0's MultiSentencePiece with normalize=True, then
DocLM, the two steps cc_net/mine.py runs), in the pipeline with its buckets, and bad input is
one line. The reference models are made here: a SentencePiece model and a bigram ARPA model
trained on normalised standard-library docstrings; held-out docstrings score far below the
same docstrings with their words shuffled."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from engine.curation.config import read_config
from engine.curation.local_text import local_documents
from engine.curation.models.arpa import write_ccnet_models
from engine.curation.models.kenlm_model import KenlmScorer, ccnet_normalize
from engine.errors import ConfigError
from tests.cli import one_line_error, run_tool
from tests.requirements import require

ODD_TEXTS = [
    "Ça coûte 12,50 € — « très » cher… Non？ 【Voilà】 ％ ►next",
    "Tabs\tand\r\nlines\nand \x07 bells; naïve café 1999–2026",
    "   ",
    "日本語の文章、句読点。「引用」",
]


@pytest.fixture(scope="module")
def ccnet_models(tmp_path_factory):
    require("kenlm")
    folder = tmp_path_factory.mktemp("ccnet_models")
    docs = local_documents(700)
    prose = [d["text"] for d in docs if d["source"].startswith("docstring:")]
    code = [d["text"] for d in docs if d["source"].startswith("source:")]
    write_ccnet_models(prose[:-30], str(folder))
    rng = np.random.default_rng(0)
    shuffled = [" ".join(rng.permutation(t.split())) for t in prose[-30:]]
    return {"folder": str(folder), "held_out": prose[-30:], "shuffled": shuffled, "code": code[:30]}


def test_perplexity_equals_ccnet_code(ccnet_models):
    ccnet = require("cc_net.perplexity")
    folder = ccnet_models["folder"]
    pieces = ccnet.MultiSentencePiece({"en": f"{folder}/en.sp.model"}, field="raw_content",
                                      output_field="tokenized", normalize=True)  # fmt: skip
    model = ccnet.DocLM({"en": f"{folder}/en.arpa"}, field="tokenized", normalize=False)
    ours = KenlmScorer(folder)
    for text in ccnet_models["held_out"] + ccnet_models["code"] + ODD_TEXTS:  # also CJK
        document = model.do(pieces.do({"raw_content": text, "language": "en"}))
        if "perplexity" not in document:  # CCNet leaves a text of no pieces unscored
            assert not ccnet_normalize(text)
            continue
        assert ours.score(text, "en") == document["perplexity"], text[:60]
    held_out = np.median([ours.score(t, "en") for t in ccnet_models["held_out"]])
    shuffled = np.median([ours.score(t, "en") for t in ccnet_models["shuffled"]])
    assert held_out < shuffled / 1.2  # the same words in their order are more likely


def _rows(folder):
    return [row for f in sorted(folder.rglob("*.parquet")) for row in pq.read_table(f).to_pylist()]


def _curate(tmp_path, texts, stages, name):
    raw = tmp_path / f"{name}.jsonl"
    raw.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    config = {
        "language": False,
        "gopher_repetition": False,
        "gopher_quality": False,
        "c4": False,
        "fineweb": False,
        "exact_dedup": False,
        "minhash": False,
        **stages,
    }
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    out = tmp_path / name
    result = run_tool("curate.py", "--input", str(raw), "--output", str(out), "--config",
                      str(tmp_path / f"{name}.json"))  # fmt: skip
    return out, result


def test_kenlm_buckets_in_the_pipeline(ccnet_models, tmp_path):
    texts = ccnet_models["held_out"][:15] + ccnet_models["shuffled"][15:]
    out, result = _curate(tmp_path, texts, {"perplexity": {"kenlm": ccnet_models["folder"]}}, "o")
    assert result.returncode == 0, result.stderr
    kept, removed = _rows(out / "kept"), _rows(out / "removed")
    scorer = KenlmScorer(ccnet_models["folder"])
    for row in kept + removed:  # no language field: the default language's model
        assert row["perplexity"] == scorer.score(texts[row["id"]], "en")
    head, middle = np.percentile([r["perplexity"] for r in kept + removed], [30, 60])
    report = json.loads((out / "report.json").read_text())
    assert report["perplexity_cutoffs"]["all"] == pytest.approx([head, middle])
    assert {r["curate_reason"] for r in removed} == {"perplexity:tail"}
    assert sum(r["id"] < 15 for r in kept) >= 12  # the prose in order: the head and middle


def test_kenlm_bad_input_is_one_line(ccnet_models, tmp_path):
    folder = ccnet_models["folder"]
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "en.arpa.bin").write_text("not a model")
    (fake / "en.sp.model").write_text("not a model")
    cases = [
        ({"perplexity": {"kenlm": folder, "model": folder}}, "on with both model and kenlm"),
        ({"perplexity": {"kenlm": str(tmp_path / "none")}}, "is not a folder"),
        ({"perplexity": {"kenlm": folder}, "language": {"languages": ["en", "fr"]}},
         "has no <lang>.arpa.bin (or .arpa) with <lang>.sp.model for fr"),
    ]  # fmt: skip
    for i, (stages, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(stages))
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_config(str(path))
    # through the tool: one line, nothing written
    out, result = _curate(tmp_path, ["Some text."], {"perplexity": {"kenlm": str(fake)}}, "run")
    assert "is neither a KenLM binary nor an ARPA file" in one_line_error(result)
    assert not out.exists()
