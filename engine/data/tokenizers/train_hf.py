"""Training a byte-level BPE with Hugging Face's `tokenizers` (the kind GPT-2 and Llama-3 use).

Whole documents are fed to the trainer (newlines included, so runs of them become tokens);
the pre-tokenizer is GPT-2's byte-level split without a prefix space, so every text encodes
without <unk>. The folder written holds tokenizer.json with its tokenizer_config.json (what
HuggingFaceTokenizer and AutoTokenizer load) and GPT-2's vocab.json + merges.txt (what
GPT2BPETokenizer loads). <|endoftext|> (id 0) ends documents; <|pad|> (id 1) pads. The held-out
report is the SentencePiece trainer's: every 50th document, tokens per word, bytes per token.
"""

from __future__ import annotations

import os
import shutil

from engine.data.prepare.readers import expand_inputs
from engine.data.tokenizers.train_sentencepiece import TokenizerReport, _Corpus, heldout_report
from engine.errors import InputError
from engine.files.outputs import probe_writable_folder, replace_folder
from parallel.errors import describe_os_error

EOD_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
BYTE_TOKENS = 256
WRITTEN = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
}


def train_hf_tokenizer(
    inputs: str | list[str],
    output_dir: str,
    vocab_size: int = 32000,
    json_keys: list[str] | None = None,
    max_sentence_length: int = 16384,
    skip_bad_records: bool = False,
) -> TokenizerReport:
    """Train and write the folder `output_dir` (replaced whole, only once complete)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= BYTE_TOKENS + 2:
        raise InputError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs more than {BYTE_TOKENS + 2} "
            "(256 bytes and 2 special tokens)"
        )
    files = expand_inputs(inputs)
    if os.path.isdir(output_dir):
        others = sorted(set(os.listdir(output_dir)) - WRITTEN)
        if others:
            raise InputError(
                f"--output-dir {output_dir} holds other files ({others[0]}, ...); it is replaced "
                "whole, so give a new folder or one holding only a tokenizer"
            )
    elif os.path.exists(output_dir):
        raise InputError(f"--output-dir {output_dir} is a file; give a folder name")
    parent = os.path.dirname(os.path.abspath(output_dir))
    try:
        probe_writable_folder(parent)
    except OSError as err:
        raise InputError(f"--output-dir: {describe_os_error(err, parent, writing=True)}") from None
    corpus = _Corpus(files, list(json_keys or ["text"]), max_sentence_length, skip_bad_records)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    try:
        backend.train_from_iterator(corpus.documents(), trainer)
    except Exception:
        if corpus.error is not None:  # the input's own error, not the trainer's retelling
            raise corpus.error from None
        raise
    if corpus.train_documents == 0:
        raise InputError(f"{files[0]}: no documents with text to train on; check --json-keys")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOD_TOKEN,
        eos_token=EOD_TOKEN,
        unk_token=EOD_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tmp = f"{output_dir.rstrip('/')}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(tmp)
        backend.model.save(tmp)  # vocab.json + merges.txt
        replace_folder(tmp, output_dir)
    except OSError as err:
        raise InputError(describe_os_error(err, output_dir, writing=True)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    encoded = [e.ids for e in backend.encode_batch(corpus.heldout)]
    return heldout_report(corpus, output_dir, backend.get_vocab_size(), encoded)
