"""--eval-prompts: greedy continuations decoded by the training ranks under TP 2 x PP 2 (with
sequence parallelism) and under CP 2 equal one process's greedy decoding of the same
checkpoint, and the sampled ones are the same on every layout given the same seed; they reach
the JSONL."""

from __future__ import annotations

import json

import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.eval.generate import greedy_generate
from engine.eval.samples import next_tokens
from engine.model import BuildContext, GPTModel
from tests.test_training import base_args, pretrain, records

PROMPTS = ["import os\n", "def __init__(self", "class Foo:\n    "]


def test_samples_under_tp_and_pp_equal_one_process(dataset_prefix, tokenizer_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS) + "\n")
    found = {}
    for world, layout in ((1, {}), (4, {"--tensor-model-parallel-size": "2",
                                        "--pipeline-model-parallel-size": "2",
                                        "--sequence-parallel": True}),
                          (2, {"--context-parallel-size": "2"})):  # fmt: skip
        log = str(tmp_path / f"log{world}.jsonl")
        save = str(tmp_path / f"ckpt{world}")
        args = base_args(
            dataset_prefix, tokenizer_model, **layout,
            **{"--train-iters": "4", "--eval-interval": "2", "--log-jsonl": log, "--save": save,
               "--eval-prompts": str(prompts), "--eval-max-new-tokens": "6",
               "--hidden-dropout": "0", "--attention-dropout": "0",
               # large random weights, barely trained: continuations that vary token by token
               "--init-method-std": "0.5", "--lr": "1e-6", "--min-lr": "1e-7",
               "--untie-embeddings-and-output-weights": True},
        )  # fmt: skip
        assert pretrain(world, args) == [0] * world
        found[world] = [r for r in records(log) if "samples" in r]
    # at iteration 2 (during training) and 4 (the end)
    assert [r["iteration"] for r in found[1]] == [r["iteration"] for r in found[4]] == [2, 4]
    assert [r["iteration"] for r in found[2]] == [2, 4]
    path = iteration_dir(str(tmp_path / "ckpt1"), 4)
    cfg = ModelConfig(**read_meta(path)["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    from engine.config.tokenizer import TokenizerConfig
    from engine.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tokenizer_model))
    for k, sample in enumerate(found[1][-1]["samples"]):
        ids = tokenizer.tokenize(PROMPTS[k].replace("\n", " "))
        expected = greedy_generate(model, ids, 6, eos_id=tokenizer.eod)[len(ids) :]
        assert sample["greedy_ids"] == expected, (k, sample, expected)
        assert len(set(expected)) > 2  # the test can see a wrong position or row
        assert len(sample["sampled_ids"]) > 0
    for world in (4, 2):
        for one, other in zip(found[1], found[world], strict=True):
            for a, b in zip(one["samples"], other["samples"], strict=True):
                assert a["greedy_ids"] == b["greedy_ids"], (world, a, b)
                assert a["sampled_ids"] == b["sampled_ids"], (world, a, b)
                assert a["prompt"] and json.dumps(a)  # plain data


def test_top_p_keeps_the_smallest_set_holding_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    drawn = {int(next_tokens(logits, 1.0, 0.7, generator)) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 >= 0.7: the first two only
    drawn = {int(next_tokens(logits, 1.0, 1.0, generator)) for _ in range(400)}
    assert drawn == {0, 1, 2, 3}
    assert int(next_tokens(logits, 1.0, 0.7, None)) == 0  # no generator: the argmax
