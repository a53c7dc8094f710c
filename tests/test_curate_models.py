"""tools/curate.py's model and list stages: the fastText classifier trained by
tools/train_quality_classifier.py (quality and toxicity direction, scores equal to datatrove's
classifier filter), the bad-words lists (decisions equal to datatrove's C4 bad-words filter),
the perplexity buckets under a tripod model and its Hugging Face export (perplexities equal to
transformers' own loss), the per-language output, the fields written, and their bad input."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from engine.curation.bad_words import BadWords, BadWordsMatcher
from engine.curation.local_text import local_documents
from engine.curation.models.classifier import ClassifierScorer, QualityClassifier
from engine.curation.models.perplexity import Perplexity, PerplexityScorer, prepare_reference
from tests.cli import one_line_error, run_tool
from tests.requirements import require

FRENCH = (
    "Le fermier a marché jusqu'à la rivière et il a regardé les bateaux du port pendant que "
    "les enfants jouaient dans le jardin de la vieille maison. "
)


def _jsonl(path, texts, **fields):
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": i, **fields}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def local_corpus():
    """Prose (standard-library docstrings) and code (standard-library sources), held apart."""
    docs = local_documents(1500)
    prose = [d["text"] for d in docs if d["source"].startswith("docstring:")]
    code = [d["text"] for d in docs if d["source"].startswith("source:")]
    return {"prose": prose, "code": code}


@pytest.fixture(scope="module")
def classifier(local_corpus, tmp_path_factory):
    """A prose-vs-code classifier trained by the tool on all but the last 40 of each."""
    folder = tmp_path_factory.mktemp("classifier")
    positive = _jsonl(folder / "prose.jsonl", local_corpus["prose"][:-40])
    negative = _jsonl(folder / "code.jsonl", local_corpus["code"][:-40])
    model = str(folder / "prose.bin")
    result = run_tool("train_quality_classifier.py", "--positive", positive, "--negative",
                      negative, "--output", model, "--epoch", "10")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return {"model": model, "stdout": result.stdout}


def _curate(tmp_path, inputs, config, name="out"):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    out = tmp_path / name
    result = run_tool("curate.py", "--input", *inputs, "--output", str(out), "--config", str(path))
    assert result.returncode == 0, result.stderr
    return out


def _rows(folder):
    files = sorted(
        os.path.join(root, n) for root, _, names in os.walk(folder) for n in names
        if n.endswith(".parquet")
    )  # fmt: skip
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def test_the_trained_classifier_separates_held_out_prose_from_code(classifier, local_corpus):
    stdout = classifier["stdout"]
    auc = float(stdout.split("AUC ")[1].split()[0])
    assert auc > 0.95, stdout
    scorer = ClassifierScorer("quality_classifier", QualityClassifier(model=classifier["model"]))
    prose = [scorer.score(t) for t in local_corpus["prose"][-40:]]  # never seen by the training
    code = [scorer.score(t) for t in local_corpus["code"][-40:]]
    assert np.mean(np.array(prose) >= 0.5) > 0.9 and np.mean(np.array(code) < 0.5) > 0.9


def test_training_is_the_seed_s(classifier, local_corpus, tmp_path):
    """One thread: the same seed gives the same model file, another seed another."""
    positive = _jsonl(tmp_path / "p.jsonl", local_corpus["prose"][:200])
    negative = _jsonl(tmp_path / "n.jsonl", local_corpus["code"][:200])
    outputs = []
    for name, seed in (("a.bin", "0"), ("b.bin", "0"), ("c.bin", "1")):
        args = ["--positive", positive, "--negative", negative, "--output", str(tmp_path / name)]
        assert run_tool("train_quality_classifier.py", *args, "--seed", seed).returncode == 0
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1] and outputs[0] != outputs[2]


def test_scores_equal_datatrove_fasttext_filter(classifier, local_corpus, monkeypatch, tmp_path):
    require("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.filters import FastTextClassifierFilter

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # datatrove copies the model there
    theirs = FastTextClassifierFilter(
        classifier["model"], keep_labels=("hq", 0.5), newline_replacement=" "
    )
    ours = ClassifierScorer("quality_classifier", QualityClassifier(model=classifier["model"]))
    for text in local_corpus["prose"][-10:] + local_corpus["code"][-10:]:
        doc = Document(text=text, id="x")
        kept = theirs.filter(doc)
        score = ours.score(text)
        assert score == pytest.approx(doc.metadata["__label__hq"], abs=1e-6)
        assert (ours.reason(score) is None) == bool(kept)


def test_classifier_stages_keep_remove_and_write_scores(classifier, local_corpus, tmp_path):
    texts = local_corpus["prose"][-20:] + local_corpus["code"][-20:]
    raw = _jsonl(tmp_path / "raw.jsonl", texts)
    stages = {"language": False, "gopher_repetition": False, "gopher_quality": False,
              "c4": False, "fineweb": False, "exact_dedup": False, "minhash": False}  # fmt: skip
    quality = {**stages, "quality_classifier": {"model": classifier["model"]}}
    out = _curate(tmp_path, [raw], quality, "quality")
    kept, removed = _rows(out / "kept"), _rows(out / "removed")
    scorer = ClassifierScorer("quality_classifier", QualityClassifier(model=classifier["model"]))
    assert len(kept) + len(removed) == 40 and kept and removed
    for row in kept:
        assert row["quality_score"] >= 0.5
    for row in removed:
        assert row["quality_score"] < 0.5
        assert row["curate_reason"] == "quality_classifier:below_threshold"
    for row in kept + removed:
        assert row["quality_score"] == pytest.approx(scorer.score(texts[row["id"]]), abs=1e-7)
    assert sum(r["id"] >= 20 for r in removed) >= 18  # the code goes
    # the same model as a toxicity filter on its negative label: code scores high, removed
    toxic = {**stages, "toxicity_classifier": {"model": classifier["model"], "label": "cc"}}
    out = _curate(tmp_path, [raw], toxic, "toxic")
    removed = _rows(out / "removed")
    assert {r["curate_reason"] for r in removed} == {"toxicity_classifier:above_threshold"}
    assert all(r["toxicity_score"] >= 0.5 for r in removed)
    assert all(r["toxicity_score"] < 0.5 for r in _rows(out / "kept"))
    assert sum(r["id"] >= 20 for r in removed) >= 18


def _word_lists(folder):
    folder.mkdir()
    (folder / "en").write_text("badword\nrude phrase\nb.d\nsm\n")
    (folder / "ja").write_text("悪口\nsm\n")
    return str(folder)


BAD_WORD_CASES = [
    ("en", "A clean sentence about the weather."),
    ("en", "This has a Badword in it."),
    ("en", "badwords are not the word itself"),
    ("en", "ends with badword"),
    ("en", "(badword) in brackets"),
    ("en", "a rude phrase here"),
    ("en", "a rude\nphrase split by a line"),
    ("en", "the b.d entry with a dot and bxd without"),
    ("en", "only bxd here"),
    ("en", "sm is allowed by C4's list"),
    ("ja", "これは悪口です"),
    ("ja", "きれいな文です"),
    ("ja", "smile"),
]


def test_bad_words_equal_datatrove_c4_filter(tmp_path, monkeypatch):
    """Each decision equals datatrove's C4BadWordsFilter reading the same lists (placed in
    its download cache), word boundaries, phrases, escaping, unspaced Japanese, allowlist."""
    require("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.filters import C4BadWordsFilter, c4_filters

    lists = _word_lists(tmp_path / "lists")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    theirs = C4BadWordsFilter()
    for language in ("en", "ja"):  # where datatrove's downloader looks: the lists pre-placed
        url = c4_filters._EN_BADWORDS_URL if language == "en" else c4_filters._BADWORDS_URL + "ja"
        from datatrove.io import cached_asset_path_or_download

        def copy(remote_path, local_path, progress, language=language):
            with open(os.path.join(lists, language), "rb") as f, open(local_path, "wb") as g:
                g.write(f.read())

        monkeypatch.setattr("datatrove.io.download_file", copy)
        cached_asset_path_or_download(url, namespace="filters", subfolder="c4_badwords")
    ours = BadWordsMatcher(BadWords(lists=lists))
    decisions = []
    for language, text in BAD_WORD_CASES:
        verdict = theirs.filter(Document(text=text, id="x", metadata={"language": language}))
        removed = ours.reason(text, language) == "bad_words:found"
        assert removed == (verdict is not True), (language, text)
        decisions.append(removed)
    assert decisions == [False, True, False, True, True, True, False, True, False, False, True,
                         False, False]  # fmt: skip


def test_bad_words_keep_fraction_is_a_hash_not_an_order(tmp_path):
    lists = _word_lists(tmp_path / "lists")
    texts = [f"document {i} with a badword" for i in range(400)]
    half = BadWordsMatcher(BadWords(lists=lists, keep_fraction=0.5, seed=3))
    first = [half.reason(t, "en") for t in texts]
    again = BadWordsMatcher(BadWords(lists=lists, keep_fraction=0.5, seed=3))
    assert [again.reason(t, "en") for t in reversed(texts)] == first[::-1]
    assert 150 < first.count(None) < 250


def test_a_document_language_without_a_list_is_one_line(tmp_path):
    """With the language stage off, a document's own `language` field picks the list."""
    lists = _word_lists(tmp_path / "lists")
    raw = tmp_path / "raw.jsonl"
    rows = [{"text": "a clean text", "language": "en"}, {"text": "ein Text", "language": "de"}]
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.json"
    off = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb")
    config.write_text(json.dumps({**dict.fromkeys(off, False), "bad_words": {"lists": lists}}))
    result = run_tool("curate.py", "--input", str(raw), "--output", str(tmp_path / "o"),
                      "--config", str(config))  # fmt: skip
    assert f"{lists}/de: no word list for a document of language 'de'" in one_line_error(result)


def test_per_language_output_and_language_fields(tmp_path):
    english = [f"{t}\n" * 3 for t in (d["text"] for d in local_documents(60)[:30:3])]
    raw = _jsonl(tmp_path / "raw.jsonl", english + [FRENCH * (3 + i) for i in range(4)])
    config = {"language": {"languages": ["en", "fr"], "output_per_language": True},
              "gopher_repetition": False, "gopher_quality": False, "c4": False,
              "fineweb": False, "exact_dedup": False, "minhash": False}  # fmt: skip
    out = _curate(tmp_path, [raw], config)
    assert sorted(os.listdir(out / "kept")) == ["en", "fr"]
    for language in ("en", "fr"):
        rows = _rows(out / "kept" / language)
        assert rows and {r["language"] for r in rows} == {language}
        assert all(0.65 <= r["language_score"] <= 1.0 for r in rows)
    assert len(_rows(out / "kept" / "fr")) == 4


@pytest.fixture(scope="module")
def perplexity_inputs(local_corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("perplexity")
    texts = [t[:600] for t in local_corpus["prose"][:15] + local_corpus["code"][:15]]
    return _jsonl(folder / "raw.jsonl", texts), texts


def _scorer(params: Perplexity, work) -> PerplexityScorer:
    """The scorer every task of a run would build (a Hugging Face folder imported once)."""
    os.makedirs(work, exist_ok=True)
    with open(prepare_reference(params, str(work))) as f:
        reference = json.load(f)
    return PerplexityScorer(params, reference["folder"], reference["iteration"])


def test_perplexity_equals_transformers_loss_on_the_export(small_checkpoint_hf, tmp_path):
    """The scorer's perplexity of a text under the Hugging Face folder is exp of
    transformers' own loss on the same tokens (the first predicted from the BOS/EOD)."""
    transformers = require("transformers")
    import torch

    scorer = _scorer(Perplexity(model=small_checkpoint_hf, max_tokens=20), tmp_path / "work")
    model = transformers.AutoModelForCausalLM.from_pretrained(small_checkpoint_hf).double()
    for text in ("The cat sat on the mat.", "def f(x):\n    return x + 1\n"):
        ids = [scorer.prefix, *scorer.tokenizer.tokenize(text)[:20]]
        with torch.no_grad():
            loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
        assert scorer.score(text) == pytest.approx(math.exp(float(loss)), rel=1e-4)


def test_perplexity_buckets_in_the_pipeline(small_checkpoint, perplexity_inputs, tmp_path):
    raw, texts = perplexity_inputs
    config = {"language": False, "gopher_repetition": False, "gopher_quality": False,
              "c4": False, "fineweb": False, "exact_dedup": False, "minhash": False,
              "perplexity": {"model": small_checkpoint}}  # fmt: skip
    out = _curate(tmp_path, [raw], config)
    kept, removed = _rows(out / "kept"), _rows(out / "removed")
    assert len(kept) + len(removed) == len(texts)
    scores = np.array([r["perplexity"] for r in kept + removed])
    head, middle = np.percentile(scores, [30, 60])
    report = json.loads((out / "report.json").read_text())
    assert report["perplexity_cutoffs"]["all"] == pytest.approx([head, middle])
    assert {r["curate_reason"] for r in removed} == {"perplexity:tail"}
    assert all(r["perplexity"] >= middle for r in removed)
    for row in kept:
        expected = "head" if row["perplexity"] < head else "middle"
        assert row["perplexity_bucket"] == expected
    assert len(removed) == 12  # 40% of 30
    scorer = _scorer(Perplexity(model=small_checkpoint), tmp_path / "work")
    for row in kept[:3]:
        assert row["perplexity"] == pytest.approx(scorer.score(texts[row["id"]]), rel=1e-9)
    # fixed cutoffs, and only the head kept
    fixed = {**config, "perplexity": {"model": small_checkpoint, "keep": ["head"],
                                      "cutoffs": [float(head), float(middle)]}}  # fmt: skip
    out = _curate(tmp_path, [raw], fixed, "fixed")
    assert {r["perplexity_bucket"] for r in _rows(out / "kept")} == {"head"}
    assert len(_rows(out / "kept")) == 9


def test_model_stage_errors_are_one_line(classifier, small_checkpoint, tmp_path):
    raw = _jsonl(tmp_path / "raw.jsonl", ["A short text about nothing in particular."])
    not_a_model = tmp_path / "model.bin"
    not_a_model.write_text("hello")
    cases = [
        ({"quality_classifier": True}, "quality_classifier: on without a model"),
        ({"quality_classifier": {"model": str(tmp_path / "none.bin")}}, "cannot read it"),
        ({"quality_classifier": {"model": str(not_a_model)}}, "is not a fastText model file"),
        ({"quality_classifier": {"model": classifier["model"], "label": "good"}},
         "quality_classifier.label 'good': not a label of"),
        ({"toxicity_classifier": {"model": classifier["model"], "threshold": 2}},
         "threshold 2 is not between 0 and 1"),
        ({"bad_words": True}, "is not a folder"),
        ({"bad_words": {"lists": str(tmp_path)}, "language": {"languages": ["en", "de"]}},
         "has no list for en, de"),
        ({"perplexity": True}, "perplexity: on without a model"),
        ({"perplexity": {"model": str(tmp_path / "nowhere")}}, "is not a folder"),
        ({"perplexity": {"model": str(tmp_path), "keep": ["top"]}}, "give some of head"),
        ({"perplexity": {"model": str(tmp_path), "cutoffs": [9, 3]}}, "give the lower first"),
        ({"perplexity": {"model": str(tmp_path)}}, "holds no checkpoint"),
        ({"perplexity": {"model": small_checkpoint, "cutoffs": [3, 9]},
          "language": {"languages": ["en", "fr"]}}, "perplexity.cutoffs are one language's"),
        ({"quality_classifier": {"model": classifier["model"], "field": "language"}},
         "quality_classifier.field 'language' is taken"),
    ]  # fmt: skip
    for i, (config, message) in enumerate(cases):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps(config))
        out = tmp_path / f"o{i}"
        result = run_tool("curate.py", "--input", raw, "--output", str(out), "--config", str(path))
        assert message in one_line_error(result), config
        assert not out.exists()  # refused before the run writes anything


def test_train_tool_bad_input_is_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    some = _jsonl(tmp_path / "some.jsonl", ["a text", "another text"])
    model = str(tmp_path / "m.bin")
    cases = [
        (["--positive", str(empty), "--negative", some], "--positive: no documents"),
        (["--positive", some, "--negative", str(tmp_path / "none")], "no such file"),
        (["--positive", some, "--negative", some, "--validation", "1"], "--validation 1.0"),
        (["--positive", some, "--negative", some, "--positive-label", "cc"], "two different"),
        (["--positive", some, "--negative", some, "--epoch", "0"], "--epoch 0: give at least 1"),
        (["--positive", some, "--negative", some, "--output", str(tmp_path)], "is a folder"),
    ]
    for args, message in cases:
        result = run_tool("train_quality_classifier.py", "--output", model, *args)
        assert message in one_line_error(result), args
        assert not os.path.exists(model)
