"""Multiple-choice tasks scored during training (--eval-tasks), under the run's own layout, by
the same rules as tools/evaluate.py (engine/eval/multiple_choice.py's `score`).

A task's questions are turned into (context, continuation) token pairs once, at set-up (a
choice longer than --seq-length is refused there). Each scoring runs the pairs through the
run's pipeline schedule, forward only, --micro-batch-size sequences at a time: a sequence is
the pair cut from the left to --seq-length + 1 tokens, its labels are the next tokens, and its
loss mask covers the continuation, so the model's own token losses (vocabulary-parallel under
TP, cut along the sequence under CP) summed over the mask are minus the continuation's
log-likelihood. The sums are made whole over the CP group and known to every pipeline stage;
data-parallel replicas score the same sequences. `score` then reads them in the order it asked
for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import InputError
from engine.eval.multiple_choice import Question, read_task, score
from engine.train.loss import output_parts
from engine.train.step import forward_step
from parallel.context_parallel.chunks import context_parallel_batches


@dataclass(frozen=True)
class Task:
    name: str
    questions: list[Question]
    pairs: list[tuple[list[int], list[int]]]  # what `score` asks for, in its order


@dataclass(frozen=True)
class EvalTasks:
    """--eval-tasks as a run scores them: the tasks, the tokenizer that encodes them (without
    the BOS/EOS it may add) and the token that pads a sequence."""

    tasks: list[Task]
    tokenizer: object
    pad: int


def read_tasks(paths: list[str], tokenizer, seq_length: int) -> list[Task]:
    """The tasks of --eval-tasks with their token pairs; InputError (one line) for a bad file
    or a choice that cannot fit."""
    prefix = tokenizer.bos if getattr(tokenizer, "bos", None) is not None else tokenizer.eod
    tasks = []
    for path in paths:
        questions = read_task(path)
        asked = _asked(questions, tokenizer, prefix)
        for _, continuation in asked:
            if not 1 <= len(continuation) <= seq_length:
                raise InputError(
                    f"--eval-tasks {path}: a choice of {len(continuation)} tokens does not fit "
                    f"--seq-length {seq_length}; shorten the task's choices"
                )
        name = os.path.splitext(os.path.basename(path))[0]
        tasks.append(Task(name, questions, asked))
    return tasks


def _asked(questions: list[Question], tokenizer, prefix: int) -> list[tuple[list[int], list[int]]]:
    """The (context, continuation) pairs `score` asks for, in its order (an empty context is
    `prefix`, as tools/evaluate.py scores it)."""
    asked = []

    def record(context: list[int], continuation: list[int]) -> float:
        asked.append((context or [prefix], continuation))
        return 0.0

    score(record, tokenizer, questions)
    return asked


def loglikelihoods(decoding, pairs, pad: int, packing=None) -> list[float]:
    """The summed log-probability of each pair's continuation after its context, under the
    run's layout (`decoding`: engine/eval/samples.py's Decoding). Collective on every rank;
    every rank returns the same."""
    out: list[float] = []
    for start in range(0, len(pairs), decoding.rows):
        out += _rows(decoding, pairs[start : start + decoding.rows], pad, packing)
    return out


def _rows(decoding, group, pad: int, packing) -> list[float]:
    state, seq, rows = decoding.state, decoding.seq_length, decoding.rows
    tokens = torch.full((rows, seq), pad, dtype=torch.long)
    labels = torch.full((rows, seq), pad, dtype=torch.long)
    mask = torch.zeros(rows, seq)
    for r, (context, continuation) in enumerate(group):
        whole = (context + continuation)[-(seq + 1) :]
        length = len(whole) - 1
        tokens[r, :length] = torch.tensor(whole[:-1])
        labels[r, :length] = torch.tensor(whole[1:])
        mask[r, length - len(continuation) : length] = 1.0
    batch = {"tokens": tokens, "labels": labels}
    if packing is not None:  # positions and documents as in training; the mask is the choice's
        batch = packing.annotate(batch)
    batch["loss_mask"] = mask
    found: list[torch.Tensor] = []

    def summed(output, micro_batch):
        token_losses = output_parts(output)[0].float()
        if not found:  # (the interleaved schedule runs copies of the micro-batch)
            found.append((token_losses * micro_batch["loss_mask"]).sum(dim=1).detach())
        return token_losses.sum() * 0.0, token_losses.new_zeros(())

    copies = state.pp_size if len(decoding.chunks) > 1 else 1
    whole = [{k: v.to(state.device) for k, v in batch.items()} for _ in range(copies)]
    for chunk in decoding.chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            decoding.schedule(decoding.chunks, context_parallel_batches(whole, state),
                              forward_step, summed, forward_only=True)  # fmt: skip
    finally:
        for chunk in decoding.chunks:
            chunk.train()
    sums = torch.zeros(rows, dtype=torch.float64, device=state.device)
    if found:
        sums += found[0].double()
        if state.cp_group is not None:  # each CP rank held part of every sequence
            dist.all_reduce(sums, group=state.cp_group)
    if state.pp_group is not None:  # only the last stage computed them
        dist.all_reduce(sums, group=state.pp_group)
    return (-sums[: len(group)]).tolist()


def score_tasks(decoding, tasks: list[Task], pad: int, tokenizer, packing=None) -> dict:
    """{task name: {acc, acc_norm, gold_ll (the gold choices' mean log-likelihood), n}} under
    the run's layout (collective)."""
    results = {}
    for task in tasks:
        values = iter(loglikelihoods(decoding, task.pairs, pad, packing))

        def answer(context, continuation, values=values) -> float:
            return next(values)

        found = score(answer, tokenizer, task.questions)
        gold = [item["loglikelihoods"][question.gold]
                for item, question in zip(found["items"], task.questions, strict=True)]  # fmt: skip
        results[task.name] = {"acc": found["acc"], "acc_norm": found["acc_norm"],
                              "gold_ll": sum(gold) / len(gold), "n": found["n"]}  # fmt: skip
    return results
