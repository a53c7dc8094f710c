"""Training a SentencePiece tokenizer on raw documents, and measuring it on held-out ones.

Documents are fed to SentencePiece line by line: "\\n" is a user-defined symbol (so pieces never
cross a line and newlines survive a round trip), text is not normalised and whitespace is kept
(code stays code), and no dummy prefix is added, so a line trains exactly as it later encodes.
A line longer than --max-sentence-length bytes is split into chunks rather than silently
dropped (SentencePiece's own behaviour); the report counts the splits. Every 50th document is
held out to measure fertility (tokens per whitespace-separated word) and bytes per token.

Bad input is one InputError line, found before training where it can be, and SentencePiece's
own multi-line reports never reach the user: a bad record (skipped and counted instead with
--skip-bad-records), a --vocab-size not above the reserved pieces or beyond what the input
yields, input without text, and a --model-prefix that cannot be written.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.data.indexed.dataset import writing
from engine.data.prepare.readers import decode_record, expand_inputs, iter_records
from engine.data.tokenizers.sentencepiece import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from engine.errors import InputError
from engine.files.outputs import probe_writable_folder

HELDOUT_EVERY = 50
SPECIAL_PIECES = 4  # <unk>, <s>, </s>, <pad>
BYTE_PIECES = 256  # <0x00> ... <0xFF> with byte fallback


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
    skipped: int = 0
    skip_messages: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"wrote {self.model_path} (vocab {self.vocab_size}); trained on "
            f"{self.train_documents} documents ({self.lines_split} over-long lines split; bad "
            f"records skipped: {self.skipped}); "
            f"held-out {self.heldout_documents} documents: {self.tokens_per_word:.3f} tokens "
            f"per word, {self.bytes_per_token:.3f} bytes per token"
        )


def _chunks(line: str, max_bytes: int) -> list[str]:
    """Split a line into pieces of at most max_bytes UTF-8 bytes, on character boundaries (a
    character longer than max_bytes is a piece of its own)."""
    encoded = line.encode("utf-8")
    if len(encoded) <= max_bytes:
        return [line]
    pieces, start = [], 0
    while start < len(encoded):
        end = min(start + max(max_bytes, 1), len(encoded))
        while end < len(encoded) and (encoded[end] & 0xC0) == 0x80:  # inside a character
            end -= 1
        if end == start:  # one character longer than max_bytes: take it whole
            end += 1
            while end < len(encoded) and (encoded[end] & 0xC0) == 0x80:
                end += 1
        pieces.append(encoded[start:end].decode("utf-8"))
        start = end
    return pieces


class _Corpus:
    """Iterates training lines once and keeps the held-out documents aside.

    SentencePiece's C++ trainer reports an exception raised by this iterator as a RuntimeError
    of several lines with Python stack frames in it; `error` keeps the original, so that it can
    be raised as itself once the trainer has given up.
    """

    def __init__(
        self, files: list[str], keys: list[str], max_sentence_length: int, skip_bad: bool = False
    ):
        self.files, self.keys, self.max_bytes = files, keys, max_sentence_length
        self.skip_bad = skip_bad
        self.heldout: list[str] = []
        self.train_documents = 0
        self.lines_split = 0
        self.lines_yielded = 0
        self.file_stats: dict = {}
        self.skipped = 0
        self.skip_messages: list[str] = []
        self.error: Exception | None = None

    def lines(self) -> Iterator[str]:
        """Training lines: each document split at newlines, long lines cut into chunks."""
        return self._guarded(self._texts(by_line=True))

    def documents(self) -> Iterator[str]:
        """Whole training documents, newlines kept (long ones cut into chunks)."""
        return self._guarded(self._texts(by_line=False))

    def _guarded(self, texts: Iterator[str]) -> Iterator[str]:
        try:
            for text in texts:
                self.lines_yielded += 1
                yield text
        except Exception as err:
            self.error = err
            raise

    def _texts(self, by_line: bool) -> Iterator[str]:
        records = iter_records(self.files, self.keys, self.skip_bad, self.file_stats)
        for number, record in enumerate(records):
            try:
                texts = decode_record(record, self.keys)
            except InputError as err:
                if not self.skip_bad:
                    raise
                self.skipped += 1
                if len(self.skip_messages) < 5:
                    self.skip_messages.append(str(err))
                continue
            for text in texts.values():
                if number % HELDOUT_EVERY == HELDOUT_EVERY - 1:
                    self.heldout.append(text)
                    continue
                self.train_documents += 1
                for line in text.split("\n") if by_line else [text]:
                    if not line:
                        continue
                    pieces = _chunks(line, self.max_bytes)
                    self.lines_split += len(pieces) > 1
                    yield from pieces
        # Whole files skipped (a Parquet file without the column) count as their rows.
        self.skipped += self.file_stats.get("skipped", 0)
        self.skip_messages.extend(self.file_stats.get("skip_messages", [])[:5])


def _check_vocab_size(vocab_size: int, symbols: list[str], byte_fallback: bool) -> None:
    reserved = SPECIAL_PIECES + len(symbols) + (BYTE_PIECES if byte_fallback else 0)
    if vocab_size > reserved:
        return
    parts = ["<unk> <s> </s> <pad>", 'the "\\n" symbol']
    if len(symbols) > 1:
        parts.append(f"{len(symbols) - 1} --user-defined-symbols")
    if byte_fallback:
        parts.append(f"{BYTE_PIECES} byte-fallback pieces")
    raise InputError(
        f"--vocab-size {vocab_size}: must be more than the {reserved} reserved pieces "
        f"({', '.join(parts)}); raise --vocab-size (real text wants thousands)"
    )


def _training_error(err: RuntimeError, vocab_size: int, corpus: _Corpus) -> InputError:
    """One line for SentencePiece's failure, with the flag to change."""
    where = corpus.files[0] if len(corpus.files) == 1 else f"{len(corpus.files)} input files"
    message = str(err)
    if corpus.lines_yielded == 0:
        documents = corpus.train_documents + len(corpus.heldout)
        return InputError(
            f"{where}: no text to train on ({documents} documents read, none with a non-empty "
            f"line; bad records skipped: {corpus.skipped}); check --input and --json-keys"
        )
    if "too high" in message.lower():
        at_most = re.search(r"<=\s*(\d+)", message)
        limit = f" to at most {at_most.group(1)}" if at_most else ""
        return InputError(
            f"{where}: --vocab-size {vocab_size} is more than this input yields; lower "
            f"--vocab-size{limit} or give more input"
        )
    too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_small:
        return InputError(
            f"{where}: --vocab-size {vocab_size} cannot hold the reserved pieces and every "
            f"character of this input; raise --vocab-size to at least {too_small.group(1)} or "
            "lower --character-coverage"
        )
    detail = " ".join(message.split())  # SentencePiece's text may span lines
    return InputError(f"SentencePiece could not train on {where}: {detail}")


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
    skip_bad_records: bool = False,
) -> TokenizerReport:
    """Train `<model_prefix>.model` / `.vocab` (written atomically) and report on held-out text."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise InputError(f"--model-type {model_type}: choose bpe or unigram")
    symbols = ["\n"] + [s for s in dict.fromkeys(user_defined_symbols or []) if s != "\n"]
    _check_vocab_size(vocab_size, symbols, byte_fallback)
    files = expand_inputs(inputs)
    _check_writable(model_prefix)
    corpus = _Corpus(files, list(json_keys or ["text"]), max_sentence_length, skip_bad_records)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    failure = None
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
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            unk_piece="<unk>",
            bos_piece="<s>",
            eos_piece="</s>",
            pad_piece="<pad>",
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        failure = err
    if corpus.error is not None:  # the input's own error, not SentencePiece's retelling of it
        raise corpus.error from None
    if failure is not None:
        raise _training_error(failure, vocab_size, corpus) from None
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    _write_atomically(model_prefix, processor, model.getvalue())
    return heldout_report(
        corpus,
        f"{model_prefix}.model",
        processor.GetPieceSize(),
        [processor.EncodeAsIds(text) for text in corpus.heldout],
    )


def heldout_report(corpus: _Corpus, path: str, vocab_size: int, encoded) -> TokenizerReport:
    """The report on a trained tokenizer: `encoded` holds the ids of corpus.heldout."""
    tokens = sum(len(ids) for ids in encoded)
    words = sum(len(text.split()) for text in corpus.heldout)
    nbytes = sum(len(text.encode("utf-8")) for text in corpus.heldout)
    return TokenizerReport(
        model_path=path,
        vocab_size=vocab_size,
        train_documents=corpus.train_documents,
        heldout_documents=len(corpus.heldout),
        lines_split=corpus.lines_split,
        tokens_per_word=tokens / max(words, 1),
        bytes_per_token=nbytes / max(tokens, 1),
        skipped=corpus.skipped,
        skip_messages=corpus.skip_messages,
    )


def _check_writable(model_prefix: str) -> None:
    """Fail now, not after training, if `<model_prefix>.model` cannot be written."""
    with writing(f"{model_prefix}.model"):
        probe_writable_folder(os.path.dirname(os.path.abspath(model_prefix)))


def _write_atomically(model_prefix: str, processor, proto: bytes) -> None:
    """Both files in full under temporary names, then renamed: never a half-written pair."""
    escape = str.maketrans({"\n": "\\n", "\t": "\\t"})
    vocab = "".join(
        f"{processor.IdToPiece(i).translate(escape)}\t{processor.GetScore(i)}\n"
        for i in range(processor.GetPieceSize())
    )
    files = {".vocab": vocab.encode("utf-8"), ".model": proto}
    tmp = {suffix: f"{model_prefix}{suffix}.tmp.{os.getpid()}" for suffix in files}
    try:
        for suffix, data in files.items():
            with writing(f"{model_prefix}{suffix}"), open(tmp[suffix], "wb") as f:
                f.write(data)
        for suffix in files:
            with writing(f"{model_prefix}{suffix}"):
                os.replace(tmp[suffix], f"{model_prefix}{suffix}")
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
