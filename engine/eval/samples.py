"""Generation samples during training (--eval-prompts): a greedy and a sampled continuation of
each prompt, decoded by the training ranks themselves under their parallel layout.

Each decoding step is one forward-only pass of the run's pipeline schedule over a micro-batch
whose rows are prompts (padded on the right to --seq-length: attention is causal, so the
padding never reaches the position read). The last pipeline stage gathers the logits of that
position over tensor parallelism, picks the next token of every row (the argmax, or a draw with
temperature and top-p from a generator seeded by the run's seed and the iteration), and the
pipeline's ranks agree on it by a sum over the pipeline group, so every stage (and every
data-parallel replica, which decodes the same rows) holds the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import InputError
from parallel.context_parallel.chunks import context_parallel_batches, rank_positions
from parallel.state import ParallelState
from parallel.tensor_parallel.layers import gather_logits


@dataclass
class EvalPrompts:
    """--eval-prompts: the prompts as token ids, and how to decode them."""

    tokenizer: object
    ids: list[list[int]]
    max_new_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class Decoding:
    """What decoding under a run's layout uses: its model chunks and pipeline schedule, its
    process groups, the sequence length and vocabulary, and the prompts per forward pass (the
    micro-batch size)."""

    chunks: list
    schedule: Callable[..., list[torch.Tensor]]
    state: ParallelState
    seq_length: int
    vocab_size: int
    rows: int


def read_prompts(path: str, tokenizer, seq_length: int) -> list[list[int]]:
    """The prompts of `path` (one a line, blank lines skipped) as token ids."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as err:
        raise InputError(f"--eval-prompts {path}: cannot be read ({err.strerror or err})") from None
    prompts = [tokenizer.tokenize(line) for line in lines if line.strip()]
    if not prompts:
        raise InputError(f"--eval-prompts {path}: holds no prompt (one prompt a line)")
    for number, ids in enumerate(prompts, start=1):
        if not ids or len(ids) >= seq_length:
            raise InputError(
                f"--eval-prompts {path}: prompt {number} is {len(ids)} tokens; it must be "
                f"between 1 and --seq-length - 1 ({seq_length - 1})"
            )
    return prompts


def next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """[rows, V] logits -> [rows] token ids: the argmax without a generator, else a draw from
    softmax(logits / temperature) cut to the smallest set of tokens holding `top_p` of it."""
    if generator is None:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens ranked above each
    ordered = ordered.masked_fill(before >= top_p, 0.0)
    picked = torch.multinomial(ordered.cpu(), 1, generator=generator)[:, 0]
    return order.gather(1, picked.to(order.device)[:, None])[:, 0]


def decode(
    decoding: Decoding,
    prompts: list[list[int]],
    max_new_tokens: int,
    generator: torch.Generator | None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eod: int | None = None,
) -> list[list[int]]:
    """The continuations (new tokens only, up to the end-of-document token `eod`) of
    `prompts` under the run's layout. Collective on every rank; every rank returns the same."""
    rows = decoding.rows
    out: list[list[int]] = []
    for start in range(0, len(prompts), rows):
        group = prompts[start : start + rows]
        out += _decode_rows(decoding, group, max_new_tokens, generator, temperature, top_p, eod)
    return out


def _decode_rows(decoding, group, max_new_tokens, generator, temperature, top_p, eod):
    seq, rows = decoding.seq_length, decoding.rows
    tokens = torch.full((rows, seq), eod if eod is not None else 0, dtype=torch.long)
    lengths = [len(p) for p in group] + [len(group[0])] * (rows - len(group))
    for r in range(rows):
        prompt = group[r] if r < len(group) else group[0]  # spare rows repeat the first
        tokens[r, : len(prompt)] = torch.tensor(prompt)
    done = [False] * rows
    for _ in range(max_new_tokens):
        if all(done[r] or lengths[r] >= seq for r in range(len(group))):
            break  # every prompt ended or filled the sequence
        chosen = _next_position_tokens(decoding, tokens, lengths, generator, temperature, top_p)
        for r in range(rows):
            if done[r] or lengths[r] >= seq:
                done[r] = True
                continue
            tokens[r, lengths[r]] = int(chosen[r])
            lengths[r] += 1
            done[r] = eod is not None and int(chosen[r]) == eod
    return [tokens[r, len(group[r]) : lengths[r]].tolist() for r in range(len(group))]


def _next_position_tokens(
    decoding: Decoding, tokens, lengths, generator, temperature, top_p
) -> torch.Tensor:
    """One forward pass of the pipeline; every rank gets the next token of every row."""
    state, chunks = decoding.state, decoding.chunks
    positions = torch.tensor([length - 1 for length in lengths], device=state.device)
    picked: list[torch.Tensor] = []

    def forward_step(chunk, batch, input_tensor):
        module = chunk.module if hasattr(chunk, "module") else chunk
        return chunk(tokens=batch["tokens"] if module.pre_process else None, hidden=input_tensor)

    # under context parallelism this rank holds two chunks of the sequence: which positions
    held = rank_positions(tokens.shape[1], state.cp_size, state.cp_rank, state.device)
    local = [(held == p).nonzero() for p in positions.tolist()]

    def read_logits(output, batch):
        # output: [s(/cp), b, V/tp]; each row's logits at its last position, whole vocabulary
        if not picked:  # (the interleaved schedule runs copies of the micro-batch)
            rows = output.shape[1]
            at = output.new_zeros(rows, output.shape[2])
            for r in range(rows):
                if len(local[r]):
                    at[r] = output[int(local[r][0]), r]
            full = gather_logits(at, state.tp_group, decoding.vocab_size).float()
            if state.cp_group is not None:  # each row's position is on one CP rank
                dist.all_reduce(full, group=state.cp_group)
            picked.append(next_tokens(full, temperature, top_p, generator))
        return output.sum() * 0.0, output.new_zeros(())

    # the interleaved schedule runs micro-batches in groups of the pipeline size
    copies = state.pp_size if len(chunks) > 1 else 1
    whole = [{"tokens": tokens.to(state.device)} for _ in range(copies)]
    batches = context_parallel_batches(whole, state)
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            decoding.schedule(chunks, batches, forward_step, read_logits, forward_only=True)
    finally:
        for chunk in chunks:
            chunk.train()
    chosen = torch.zeros(tokens.shape[0], dtype=torch.long, device=state.device)
    if picked:
        chosen += picked[0].to(state.device)
    if state.pp_group is not None:
        dist.all_reduce(chosen, group=state.pp_group)  # only the last stage holds them
    return chosen.cpu()
