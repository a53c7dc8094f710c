"""Every tokenizer family: the same ids as Megatron-LM's own tokenizers (megatron-core) and as
transformers, an export that AutoTokenizer loads and encodes alike, and the end to end run
preprocess -> TP2 training -> export -> transformers' loss equal to the engine's."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from engine.config.tokenizer import TokenizerConfig
from engine.data.indexed.dataset import IndexedDataset
from engine.data.prepare.preprocess import preprocess
from engine.data.tokenizers import build_tokenizer
from engine.data.tokenizers.gigatoken_encoder import gigatoken_encoder
from engine.data.tokenizers.train_sentencepiece import train_tokenizer
from engine.errors import ConfigError, InputError
from tests.cli import one_line_error, run_tool
from tests.test_training import base_args, pretrain
from tests.tokenizer_files import (
    copy_gpt2_files,
    make_bos_folder,
    make_hf_folder,
    make_tiktoken_ranks,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DOCUMENTS = 200
NULL_VOCAB = 3000
KINDS = ["sentencepiece", "llama2", "hf", "hf-bos", "gpt2", "tiktoken", "null"]


@pytest.fixture(scope="module")
def files(corpus, tokenizer_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizer-files")
    hf = make_hf_folder(corpus["jsonl"], str(root / "hf"))
    vocab, merges = copy_gpt2_files(hf, str(root / "gpt2"))
    with open(corpus["jsonl"]) as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(DOCUMENTS), f, strict=False)]
    ids = build_tokenizer(_hf(hf)).tokenize_batch(docs)
    return {
        "docs": docs,
        "id_docs": [" ".join(str(i % (NULL_VOCAB - 1)) for i in doc) for doc in ids],
        "sentencepiece": TokenizerConfig(tokenizer_model=tokenizer_model),
        "llama2": TokenizerConfig(
            tokenizer_type="Llama2Tokenizer", tokenizer_model=tokenizer_model
        ),
        "hf": _hf(hf),
        "hf-bos": _hf(make_bos_folder(hf, str(root / "hf-bos"))),
        "gpt2": TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges
        ),
        "tiktoken": TokenizerConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=make_tiktoken_ranks(hf, str(root / "ranks.json")),
        ),
        "null": TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=NULL_VOCAB),
        # training without the folder's own <|begin_of_text|>; a bare tokenizer.json whose end
        # of document is named by the flag
        "hf-bos-plain": _hf(str(root / "hf-bos"), tokenizer_hf_no_include_special_tokens=True),
        "hf-file": _hf(os.path.join(hf, "tokenizer.json"), tokenizer_eod_token="<|endoftext|>"),
        "root": root,
    }


def _hf(path: str, **kw) -> TokenizerConfig:
    return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path, **kw)


def _texts(files, kind: str) -> list[str]:
    return files["id_docs"] if kind == "null" else files["docs"]


def _megatron_tokenizer(kind: str, cfg: TokenizerConfig, include_special: bool = True):
    from megatron.core.tokenizers import MegatronTokenizer

    if kind.startswith("hf"):
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=cfg.tokenizer_model,
            metadata_path={"library": "huggingface"},
            include_special_tokens=include_special,
        )
    if kind == "tiktoken":
        ours = build_tokenizer(cfg)
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=cfg.tokenizer_model,
            metadata_path={"library": "tiktoken"},
            vocab_size=ours.vocab_size,
        )
    if kind == "sentencepiece":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=cfg.tokenizer_model, metadata_path={"library": "sentencepiece"}
        )
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["hf", "hf-bos", "tiktoken", "sentencepiece"])
def test_same_ids_as_megatron_core(files, kind):
    cfg = files[kind]
    ours = build_tokenizer(cfg)
    theirs = _megatron_tokenizer(kind, cfg)
    texts = files["docs"]
    assert ours.tokenize_batch(texts) == [theirs.tokenize(t) for t in texts]
    assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size)
    if kind == "hf-bos":  # the Llama-3 style folder: tokenizer(text) starts with its bos
        assert ours.tokenize(texts[0])[0] == ours.bos != ours.eod
        plain = build_tokenizer(
            _hf(cfg.tokenizer_model, tokenizer_hf_no_include_special_tokens=True)
        )
        without = _megatron_tokenizer(kind, cfg, include_special=False)
        assert plain.tokenize_batch(texts) == [without.tokenize(t) for t in texts]
        assert plain.tokenize(texts[0])[0] != ours.bos


def test_null_tokenizer_conventions(files):
    """Megatron-LM now: --vocab-size N ids, eod N - 1; its older tokenizers (megatron-core 0.16,
    --legacy-tokenizer): N + 1 ids, eod N."""
    from megatron.core.tokenizers import MegatronTokenizer

    legacy = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="NullTokenizer", vocab_size=NULL_VOCAB, legacy_tokenizer=True
        )
    )
    theirs = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=NULL_VOCAB
    )
    texts = files["id_docs"]
    assert legacy.tokenize_batch(texts) == [theirs.tokenize(t) for t in texts]
    assert (legacy.vocab_size, legacy.eod) == (theirs.vocab_size, theirs.eod) == (3001, 3000)
    current = build_tokenizer(files["null"])
    assert (current.vocab_size, current.eod) == (NULL_VOCAB, NULL_VOCAB - 1)
    chosen = TokenizerConfig(
        tokenizer_type="NullTokenizer", vocab_size=NULL_VOCAB, null_tokenizer_eod_id=7
    )
    assert build_tokenizer(chosen).eod == 7
    assert current.tokenize("5 6\n7") == [5, 6, 7]


def test_gpt2_bpe_matches_transformers_gpt2(files):
    from transformers import GPT2TokenizerFast

    cfg = files["gpt2"]
    theirs = GPT2TokenizerFast.from_pretrained(os.path.dirname(cfg.vocab_file))
    ours = build_tokenizer(cfg)
    assert ours.tokenize_batch(files["docs"]) == [theirs.encode(t) for t in files["docs"]]
    assert ours.eod == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|endoftext|>")


def test_llama2_starts_every_document_with_bos(files):
    sp = build_tokenizer(files["sentencepiece"])
    llama = build_tokenizer(files["llama2"])
    for text in files["docs"][:20]:
        assert llama.tokenize(text) == [sp.bos, *sp.tokenize(text)]
    assert llama.eod == sp.eod == sp.eos


@pytest.mark.parametrize("kind", [*KINDS, "hf-bos-plain", "hf-file"])
def test_exported_tokenizer_encodes_like_training(files, kind, tmp_path):
    """AutoTokenizer on the folder the export writes gives every document's training ids."""
    from transformers import AutoTokenizer

    tokenizer = build_tokenizer(files[kind])
    tokenizer.save_hf(str(tmp_path))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    texts = _texts(files, kind)
    assert [auto(t)["input_ids"] for t in texts] == tokenizer.tokenize_batch(texts)
    assert auto.eos_token_id == tokenizer.eos == tokenizer.special_ids()["eos"]
    assert tokenizer.eos is not None


def _preprocess(files, kind: str, tmp_path) -> str:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(files, kind)))
    preprocess(str(src), str(tmp_path / "data"), files[kind], append_eod=True, progress=False)
    return str(tmp_path / "data_text_document")


def _tokenizer_flags(cfg: TokenizerConfig) -> dict:
    flags = {"--tokenizer-type": cfg.tokenizer_type, "--tokenizer-model": cfg.tokenizer_model}
    flags.update({"--vocab-file": cfg.vocab_file, "--merge-file": cfg.merge_file})
    if cfg.vocab_size:
        flags["--vocab-size"] = str(cfg.vocab_size)
    return flags


@pytest.mark.parametrize("kind", KINDS)
def test_preprocess_train_tp2_export_and_transformers_agree(files, kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.interop.hf.export import export_to_hf
    from tests.test_hf import engine_model

    prefix = _preprocess(files, kind, tmp_path)
    ckpt = str(tmp_path / "ckpt")
    args = base_args(prefix, None, **_tokenizer_flags(files[kind]))
    args += ["--tensor-model-parallel-size", "2", "--train-iters", "5", "--save", ckpt]
    args += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    pretrain(2, args)
    export_to_hf(ckpt, str(tmp_path / "hf"))
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    dataset = IndexedDataset(prefix)
    texts = _texts(files, kind)
    assert [auto(t)["input_ids"] + [auto.eos_token_id] for t in texts] == [
        dataset[i].tolist() for i in range(len(dataset))
    ]
    ids = torch.tensor([dataset[0].tolist()[:32]])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = engine_model(ckpt)
    with torch.no_grad():
        logits = ours.full_logits(ours(tokens=ids))
        expected = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
        got = hf(ids, labels=ids).loss.item()
    assert abs(got - expected) < 1e-4, (got, expected)


def test_refused_and_missing_inputs_are_one_line(files, tmp_path):
    hf = files["hf"].tokenizer_model
    custom = tmp_path / "custom"
    custom.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (custom / name).write_bytes((files["root"] / "hf" / name).read_bytes())
    config = json.loads((custom / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="never runs"):
        build_tokenizer(_hf(str(custom)))
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        build_tokenizer(TokenizerConfig(trust_remote_code=True, tokenizer_model=hf))
    bare = os.path.join(hf, "tokenizer.json")
    with pytest.raises(ConfigError, match="no eos token .* --tokenizer-eod-token"):
        build_tokenizer(_hf(bare))
    assert build_tokenizer(_hf(bare, tokenizer_eod_token="<|endoftext|>")).eod == 0
    with pytest.raises(ConfigError, match="'<nope>' is not a token"):
        build_tokenizer(_hf(bare, tokenizer_eod_token="<nope>"))
    with pytest.raises(InputError, match="not a Hugging Face tokenizer folder"):
        build_tokenizer(_hf(str(tmp_path)))
    ranks = tmp_path / "ranks.json"
    entries = json.loads((files["root"] / "ranks.json").read_text())
    entries[300]["token_bytes"] = "not base64!"
    ranks.write_text(json.dumps(entries))
    with pytest.raises(InputError, match="entry 300 is malformed"):
        build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(ranks)))
    with pytest.raises(ConfigError, match="--vocab-size 200000 needs 199000 ranks"):
        build_tokenizer(
            TokenizerConfig(
                tokenizer_type="TikTokenizer",
                tokenizer_model=files["tiktoken"].tokenizer_model,
                vocab_size=200000,
            )
        )
    entries = entries[:100]
    ranks.write_text(json.dumps(entries))
    with pytest.raises(InputError, match="100 ranks; a TikToken vocabulary starts with"):
        build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(ranks)))
    null = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=10))
    for text in ("1 10", "-1", "²", "--5"):
        with pytest.raises(InputError, match="NullTokenizer reads token ids 0..9"):
            null.tokenize(text)
    with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer"))
    with pytest.raises(InputError, match="--merge-file is required"):
        build_tokenizer(
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=files["gpt2"].vocab_file)
        )


@pytest.mark.parametrize(
    "kind, text, message",
    [
        ("null", "4 five 6", "NullTokenizer reads token ids"),
        ("null", "4 12 6", "NullTokenizer reads token ids"),
        ("hf", "a lone surrogate \\ud800", "text the tokenizer cannot encode"),
    ],
)
def test_text_the_tokenizer_cannot_read_names_the_line(files, kind, text, message, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "1 2 3"}) + "\n" + '{"text": "' + text + '"}\n')
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    if kind == "hf":
        flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
        flags.append(files["hf"].tokenizer_model)
    result = run_tool(
        "preprocess_data.py",
        *("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--no-progress"),
        *flags,
    )
    assert result.returncode == 2, result.stderr
    assert one_line_error(result).startswith(f"error: {src}:line 2: text: ")
    assert message in one_line_error(result)
    assert not list(tmp_path.glob("out*"))


# a special token's spelling where documents have it: in words, brackets, quotes, code, markup
ADVERSARIAL = ["a{s}b", "x = '{s}'", "({s})", "[{s}]", "f({s}, 1)", "<{s}>", "{s}{s}", "{s}\n",
               "naïve{s}café", "1{s}2", "def f():\n    return '{s}'  # {s}", " {s} "]  # fmt: skip


def _spellings(tokenizer) -> list[str]:
    hf = getattr(tokenizer, "_hf", None)
    sp = getattr(tokenizer, "_sp", None)
    if sp is not None:
        return [sp.IdToPiece(i) for i in range(sp.GetPieceSize()) if sp.IsControl(i)] + ["<unk>"]
    return list(hf.all_special_tokens) + ["<|endoftext|>", "<s>", "</s>", "[PAD]"]


@pytest.mark.parametrize("kind", ["sentencepiece", "llama2", "hf", "hf-bos", "gpt2"])
def test_the_default_preprocessing_writes_the_tokenizers_own_ids(files, corpus, kind, tmp_path):
    """`--tokenize-with` defaults to the tokenizer's library: every document's ids equal its
    own encode, on the corpus with documents that spell each special token inside words,
    brackets, quotes and code added. gigatoken (--tokenize-with auto, opt-in) is used only
    where it encodes all of those probes alike: SentencePiece models fail them (gigatoken
    0.10 gives the control id for `<s>` written in a document)."""
    tokenizer = build_tokenizer(files[kind])
    docs = files["docs"][:50]
    docs += [place.format(s=s) for s in _spellings(tokenizer) for place in ADVERSARIAL]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    if kind == "sentencepiece":  # the command line's default
        result = run_tool(
            "preprocess_data.py",
            *("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--no-progress"),
            *("--workers", "2", "--tokenizer-model", files[kind].tokenizer_model),
        )
        assert result.returncode == 0, result.stderr
    else:  # the library's default
        preprocess(str(src), str(tmp_path / "out"), files[kind], workers=2, progress=False)
    written = IndexedDataset(str(tmp_path / "out_text_document"))
    expected = tokenizer.tokenize_batch(docs)
    assert len(written) == len(docs)
    assert all(list(written[i]) == list(ids) for i, ids in enumerate(expected))
    fast = gigatoken_encoder(tokenizer)
    assert (fast is None) == kind.startswith(("sentencepiece", "llama2")), kind
    if fast is not None:  # where it passed the probes, it agrees here too
        flat, lengths = fast.encode_flat(docs)
        assert flat.tolist() == [i for ids in expected for i in ids]
        assert lengths.tolist() == [len(ids) for ids in expected]


@pytest.mark.parametrize("kind", ["hf", "hf-bos", "hf-bos-plain", "gpt2"])
def test_gigatoken_writes_the_tokenizers_own_dataset(files, corpus, kind, tmp_path):
    """gigatoken underneath preprocess (opt-in), where it passes the probes: byte-identical
    .bin/.idx to the tokenizer's library."""
    assert gigatoken_encoder(build_tokenizer(files[kind])) is not None
    for how in ("tokenizer", "gigatoken"):
        preprocess(
            corpus["jsonl"],
            str(tmp_path / how),
            files[kind],
            append_eod=True,
            workers=2,
            progress=False,
            tokenize_with=how,
        )
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"gigatoken_text_document{suffix}").read_bytes()
        assert ours == (tmp_path / f"tokenizer_text_document{suffix}").read_bytes(), suffix


def test_gigatoken_is_left_out_where_it_does_not_apply(files, corpus, tmp_path):
    unigram = tmp_path / "unigram"
    train_tokenizer([corpus["jsonl"]], str(unigram), vocab_size=600, model_type="unigram")
    for cfg in (
        TokenizerConfig(tokenizer_model=f"{unigram}.model"),
        files["tiktoken"],
        files["null"],
    ):
        assert gigatoken_encoder(build_tokenizer(cfg)) is None
    with pytest.raises(InputError, match="--tokenize-with gigatoken: gigatoken does not cover"):
        gigatoken_encoder(build_tokenizer(files["null"]), required=True)
    result = run_tool(
        "preprocess_data.py",
        *("--input", corpus["jsonl"], "--output-prefix", str(tmp_path / "out"), "--no-progress"),
        *("--tokenizer-model", f"{unigram}.model", "--use-gigatoken"),
    )
    assert "--tokenize-with gigatoken: gigatoken cannot read" in one_line_error(result)


def test_train_tokenizer_hf_writes_a_folder_both_families_load(corpus, tmp_path):
    out = tmp_path / "tok"
    result = run_tool(
        "train_tokenizer.py",
        *("--library", "hf", "--input", corpus["jsonl"], "--output-dir", str(out)),
        *("--vocab-size", "1000"),
    )
    assert result.returncode == 0, result.stderr
    assert "tokens per word" in result.stdout and "bytes per token" in result.stdout
    hf = build_tokenizer(_hf(str(out)))
    gpt2 = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(out / "vocab.json"),
            merge_file=str(out / "merges.txt"),
        )
    )
    text = "def f(x):\n\n    return x  # ünïcode ✓\n"
    assert hf.vocab_size == 1000 and hf.tokenize(text) == gpt2.tokenize(text)
    assert hf.detokenize(hf.tokenize(text)) == text and hf.eod == 0
    wrong = run_tool("train_tokenizer.py", "--library", "hf", "--input", corpus["jsonl"])
    assert wrong.returncode == 2 and "--output-dir" in one_line_error(wrong)
    base = ("--library", "hf", "--input", corpus["jsonl"], "--vocab-size", "1000")
    wrong = run_tool(
        "train_tokenizer.py", *base, "--output-dir", str(out), "--model-type", "unigram"
    )
    assert wrong.returncode == 2
    assert "--model-type is for --library sentencepiece" in one_line_error(wrong)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.bin").write_bytes(b"precious")
    wrong = run_tool("train_tokenizer.py", *base, "--output-dir", str(tmp_path / "data"))
    assert wrong.returncode == 2 and "holds other files (keep.bin" in one_line_error(wrong)
    assert (tmp_path / "data" / "keep.bin").read_bytes() == b"precious"
    again = run_tool("train_tokenizer.py", *base, "--output-dir", str(out))
    assert again.returncode == 0, again.stderr  # a tokenizer folder is replaced whole


def test_an_imported_tokenizer_continues_training(files, tmp_path):
    """Export a trained model with its Hugging Face tokenizer, import it, and continue with
    --use-checkpoint-args alone: the imported tokenizer is used. Without its files the run
    stops in one line naming the flags to give."""
    from engine.interop.hf.export import export_to_hf
    from engine.interop.hf.import_hf import import_from_hf
    from tests.test_training import _cli

    prefix = _preprocess(files, "hf-bos", tmp_path)
    ckpt = str(tmp_path / "ckpt")
    flags = _tokenizer_flags(files["hf-bos"])
    pretrain(1, base_args(prefix, None, **flags, **{"--train-iters": "3", "--save": ckpt}))
    export_to_hf(ckpt, str(tmp_path / "hf"))
    imported = tmp_path / "imported"
    import_from_hf(str(tmp_path / "hf"), str(imported))
    log = tmp_path / "log.jsonl"
    resume = {"--load": str(imported), "--use-checkpoint-args": True, "--train-iters": "3"}
    pretrain(1, base_args(prefix, None, **resume, **{"--log-jsonl": str(log)}))
    assert [json.loads(line)["iteration"] for line in log.read_text().splitlines()][:3] == [1, 2, 3]
    record = json.loads((imported / "iter_0000000" / "meta.json").read_text())["tokenizer"]
    assert record["tokenizer_type"] == "HuggingFaceTokenizer"
    assert record["tokenizer_model"] == str(imported / "tokenizer")
    (imported / "tokenizer" / "tokenizer.json").unlink()
    result = _cli(base_args(prefix, None, **resume))
    assert result.returncode == 2
    assert "name one with the tokenizer flags" in one_line_error(result)


def test_checkpoints_from_before_the_record_name_a_sentencepiece_model():
    from engine.config.tokenizer import config_from_record

    old = {"tokenizer_model": "/data/tok.model"}
    assert config_from_record(old) == TokenizerConfig(tokenizer_model="/data/tok.model")
    assert config_from_record({}) is None


def test_mock_data_trains_with_no_files_under_tp2(tmp_path):
    """Megatron-LM's Llama-3 example without data: --mock-data with NullTokenizer."""
    log = tmp_path / "log.jsonl"
    args = base_args(
        None,
        None,
        **{
            "--mock-data": True,
            "--tokenizer-type": "NullTokenizer",
            "--vocab-size": "1000",
            "--split": "99,1,0",  # ignored: mock documents split 1:1:1, as in Megatron-LM
            "--tensor-model-parallel-size": "2",
            "--train-iters": "3",
            "--eval-interval": "3",
            "--log-jsonl": str(log),
        },
    )
    pretrain(2, args)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert abs(train[0]["lm_loss"] - np.log(1000)) < 1.0
    assert any(r.get("split") == "valid" for r in records)


def test_mock_documents_are_megatron_cores(tmp_path):
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
    from megatron.core.tokenizers import MegatronTokenizer

    from engine.data.indexed.mock import MockIndexedDataset

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=500)
    theirs = MockGPTLowLevelDataset(tokenizer)
    ours = MockIndexedDataset(tokenizer.vocab_size, tokenizer.eod)
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    for i in (0, 1, 2, 99_999) + tuple(np.flatnonzero(ours.sequence_lengths == 1)[:2]):
        assert np.array_equal(ours.get(int(i)), theirs[int(i)]), i
    assert np.array_equal(ours.get(0, 10, 20), theirs.get(0, 10, 20))
