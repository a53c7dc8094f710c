"""Training a SentencePiece tokenizer on raw documents, and measuring it on held-out ones.

Documents are fed to SentencePiece line by line: "\\n" is a user-defined symbol (so pieces never
cross a line and newlines survive a round trip), text is not normalised and whitespace is kept
(code stays code), and no dummy prefix is added, so a line trains exactly as it later encodes.
A line longer than --max-sentence-length bytes is split into chunks rather than silently
dropped (SentencePiece's own behaviour); the report counts the splits. Every 50th document is
held out to measure fertility (tokens per whitespace-separated word) and bytes per token.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

from engine.data.readers import decode_record, expand_inputs, iter_records
from engine.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from engine.errors import InputError

HELDOUT_EVERY = 50


@dataclass
class TokenizerReport:
    """What training produced and how well the model compresses held-out text."""

    model_path: str
    vocab_size: int
    train_documents: int
    heldout_documents: int
    lines_split: int
    tokens_per_word: float
    bytes_per_token: float

    def summary(self) -> str:
        return (
            f"wrote {self.model_path} (vocab {self.vocab_size}); trained on "
            f"{self.train_documents} documents ({self.lines_split} over-long lines split); "
            f"held-out {self.heldout_documents} documents: {self.tokens_per_word:.3f} tokens "
            f"per word, {self.bytes_per_token:.3f} bytes per token"
        )


def _chunks(line: str, max_bytes: int) -> list[str]:
    """Split a line into pieces of at most max_bytes UTF-8 bytes, on character boundaries."""
    encoded = line.encode("utf-8")
    if len(encoded) <= max_bytes:
        return [line]
    pieces, start = [], 0
    while start < len(encoded):
        end = min(start + max_bytes, len(encoded))
        while end < len(encoded) and (encoded[end] & 0xC0) == 0x80:  # inside a character
            end -= 1
        pieces.append(encoded[start:end].decode("utf-8"))
        start = end
    return pieces


class _Corpus:
    """Iterates training lines once and keeps the held-out documents aside."""

    def __init__(self, files: list[str], keys: list[str], max_sentence_length: int):
        self.files, self.keys, self.max_bytes = files, keys, max_sentence_length
        self.heldout: list[str] = []
        self.train_documents = 0
        self.lines_split = 0

    def lines(self) -> Iterator[str]:
        for number, record in enumerate(iter_records(self.files, self.keys)):
            texts = decode_record(record, self.keys)
            for text in texts.values():
                if number % HELDOUT_EVERY == HELDOUT_EVERY - 1:
                    self.heldout.append(text)
                    continue
                self.train_documents += 1
                for line in text.split("\n"):
                    if not line:
                        continue
                    pieces = _chunks(line, self.max_bytes)
                    self.lines_split += len(pieces) > 1
                    yield from pieces


def train_tokenizer(
    inputs: str | list[str],
    model_prefix: str,
    vocab_size: int = 32000,
    model_type: str = "bpe",
    character_coverage: float = 0.9999,
    byte_fallback: bool = True,
    input_sentence_size: int = 1_000_000,
    max_sentence_length: int = 16384,
    json_keys: list[str] | None = None,
    user_defined_symbols: list[str] | None = None,
    num_threads: int | None = None,
    seed: int = 1234,
) -> TokenizerReport:
    """Train `<model_prefix>.model` / `.vocab` (written atomically) and report on held-out text."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise InputError(f"--model-type {model_type}: choose bpe or unigram")
    files = expand_inputs(inputs)
    corpus = _Corpus(files, list(json_keys or ["text"]), max_sentence_length)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    symbols = ["\n"] + [s for s in (user_defined_symbols or []) if s != "\n"]
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=corpus.lines(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=max_sentence_length,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=symbols,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>",
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise InputError(
            f"SentencePiece could not train on {len(files)} file(s): {err}; try a smaller "
            "--vocab-size or more input"
        ) from None
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    _write_atomically(model_prefix, processor, model.getvalue())
    words = tokens = nbytes = 0
    for text in corpus.heldout:
        tokens += len(processor.EncodeAsIds(text))
        words += len(text.split())
        nbytes += len(text.encode("utf-8"))
    return TokenizerReport(
        model_path=f"{model_prefix}.model",
        vocab_size=processor.GetPieceSize(),
        train_documents=corpus.train_documents,
        heldout_documents=len(corpus.heldout),
        lines_split=corpus.lines_split,
        tokens_per_word=tokens / max(words, 1),
        bytes_per_token=nbytes / max(tokens, 1),
    )


def _write_atomically(model_prefix: str, processor, proto: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(directory, exist_ok=True)
    escape = str.maketrans({"\n": "\\n", "\t": "\\t"})
    vocab = "".join(
        f"{processor.IdToPiece(i).translate(escape)}\t{processor.GetScore(i)}\n"
        for i in range(processor.GetPieceSize())
    )
    for suffix, data in ((".vocab", vocab.encode("utf-8")), (".model", proto)):
        tmp = f"{model_prefix}{suffix}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, f"{model_prefix}{suffix}")
