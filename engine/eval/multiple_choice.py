"""Zero- and few-shot multiple choice by log-likelihood, as lm-evaluation-harness scores it.

A task file is JSONL, one question a line: {"context": str, "choices": [str, ...], "gold": int}
(HellaSwag/ARC/PIQA-style after the harness's own preprocessing; "query" is accepted for
"context"). Each choice is scored by the summed log-probability of `target_delimiter + choice`
after the context; `acc` takes the highest, `acc_norm` the highest per character of the choice
(the harness's length normalisation). The pair is tokenized as the harness does for a causal
model: spaces ending the context move to the continuation, the whole text is encoded, and the
continuation is what follows the context's own encoding. With `num_fewshot` K, K other
questions of the file (drawn with `seed`) precede each one, each as its context, the delimiter
and its gold choice, joined by `fewshot_delimiter`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from engine.errors import InputError


@dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]
    gold: int


def read_task(path: str) -> list[Question]:
    """The questions of a task file; a malformed line is named in one line."""
    questions = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as err:
        raise InputError(f"{path}: cannot be read ({err.strerror or err})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{where}: not JSON ({err.msg})") from None
        context = item.get("context", item.get("query")) if isinstance(item, dict) else None
        choices = item.get("choices") if isinstance(item, dict) else None
        gold = item.get("gold") if isinstance(item, dict) else None
        if not isinstance(context, str) or not isinstance(choices, list) or not choices:
            raise InputError(
                f'{where}: needs "context" (text), "choices" (a list of texts) and "gold" '
                "(the index of the right choice)"
            )
        if not all(isinstance(c, str) for c in choices):
            raise InputError(f"{where}: every choice must be text")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
            raise InputError(
                f"{where}: gold {gold!r} is not an index into its {len(choices)} choices"
            )
        questions.append(Question(context, tuple(choices), gold))
    if not questions:
        raise InputError(f"{path}: holds no question")
    return questions


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness splits them (module doc)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.tokenize(context + continuation)
    context_ids = tokenizer.tokenize(context)
    return context_ids, whole[len(context_ids) :]


def fewshot_picks(count: int, index: int, num_fewshot: int, seed: int) -> list[int]:
    """The indices of the `num_fewshot` solved examples shown before question `index` of
    `count` (never itself), drawn by a generator seeded by `seed` and the question."""
    others = [i for i in range(count) if i != index]
    if num_fewshot > len(others):
        raise InputError(
            f"--num-fewshot {num_fewshot}: the task has only {len(others)} other questions"
        )
    return random.Random(seed * 1_000_003 + index).sample(others, num_fewshot)


def fewshot_prefix(
    questions: list[Question], picked: list[int], target_delimiter: str, fewshot_delimiter: str
) -> str:
    """The solved examples `picked` (fewshot_picks) written out before a question."""
    if not picked:
        return ""
    shots = [
        questions[i].context + target_delimiter + questions[i].choices[questions[i].gold]
        for i in picked
    ]
    return fewshot_delimiter.join(shots) + fewshot_delimiter


def score(
    loglikelihood,
    tokenizer,
    questions: list[Question],
    num_fewshot: int = 0,
    seed: int = 1234,
    target_delimiter: str = " ",
    fewshot_delimiter: str = "\n\n",
) -> dict:
    """acc, acc_norm and each question's per-choice log-likelihoods. `loglikelihood(context
    ids, continuation ids)` is the summed log-probability of the continuation."""
    right = right_norm = 0
    details = []
    count = len(questions)
    for index, question in enumerate(questions):
        shots = fewshot_picks(count, index, num_fewshot, seed) if num_fewshot else []
        prefix = fewshot_prefix(questions, shots, target_delimiter, fewshot_delimiter)
        context = prefix + question.context
        lls = []
        for choice in question.choices:
            context_ids, continuation_ids = encode_pair(
                tokenizer, context, target_delimiter + choice
            )
            lls.append(loglikelihood(context_ids, continuation_ids))
        normalised = [
            ll / max(len(choice), 1) for ll, choice in zip(lls, question.choices, strict=False)
        ]
        best = max(range(len(lls)), key=lls.__getitem__)
        best_norm = max(range(len(lls)), key=normalised.__getitem__)
        right += best == question.gold
        right_norm += best_norm == question.gold
        details.append(
            {"loglikelihoods": lls, "pick": best, "pick_norm": best_norm, "shots": shots}
        )
    return {"acc": right / count, "acc_norm": right_norm / count, "n": count, "items": details}
