"""A TikToken vocabulary as a Hugging Face tokenizer.json that encodes every text to the same
ids: byte-level BPE whose merges are ordered by the rank of the token they make (tiktoken
always merges the adjacent pair whose result has the lowest rank), the same split regex, and
the special tokens as added tokens at their ids."""

from __future__ import annotations

from transformers.convert_slow_tokenizer import bytes_to_unicode


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every way to make each multi-byte token from two tokens, lowest result rank first."""
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        pairs = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges.extend(
            (rank, left_rank, right_rank, left, right)
            for left_rank, right_rank, left, right in pairs
        )
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def save_as_hf(tokenizer, folder: str) -> None:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    byte_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    offset = tokenizer.num_special_tokens
    ranks = {token: rank for rank, token in enumerate(tokenizer.ranks)}
    vocab = {name: i for i, name in enumerate(tokenizer.special_tokens)}
    vocab.update({text(token): rank + offset for token, rank in ranks.items()})
    merges = [(text(left), text(right)) for left, right in _merges(ranks)]
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in tokenizer.special_tokens]
    )
    names = tokenizer.special_tokens
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=names[tokenizer.unk],
        bos_token=names[tokenizer.bos],
        eos_token=names[tokenizer.eos],
        pad_token=names[tokenizer.pad],
    )
    hf.save_pretrained(folder)
