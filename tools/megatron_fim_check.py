"""Check engine/data/fim.py against Megatron-LM's own fill-in-the-middle transformation
(megatron/training/datasets/fim_dataset.py's GPTFIMDataset, which is not part of the
megatron-core package) sample by sample.

    git -C MEGATRON_GIT archive core_v0.16.1 megatron/training/datasets/fim_dataset.py \
        | tar -x -C CHECKOUT
    python tools/megatron_fim_check.py CHECKOUT --data-path PREFIX --tokenizer-model M ...

Megatron-LM draws every sample's rearrangement from one generator in reading order; here
each sample has its own (seeded by the run's seed and the sample's index). The check hands
Megatron-LM's dataset the generator tripod draws sample i from, then has it read sample i
through its own code path (its sample assembly, EOD and fragment splitting, PSM/SPM, cutting
and padding), for samples of a preprocessed dataset, under several flag settings; it prints
how many samples were rearranged and how many came out equal. Exit 1 on any difference.
"""

from __future__ import annotations

import importlib.util
import os
import types

import numpy as np

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.config.fim import FimConfig
from engine.data.builder import build_gpt_datasets
from engine.data.fim import FimTransform
from engine.data.sources import data_sources
from engine.data.tokenizers import build_tokenizer
from engine.data.tokenizers.base import plain
from engine.data.tokenizers.cli import add_tokenizer_arguments, tokenizer_config
from engine.errors import InputError

SETTINGS = {
    "psm+spm": {"fim_rate": 0.9, "fim_spm_rate": 0.5},
    "psm-only": {"fim_rate": 1.0, "fim_spm_rate": 0.0},
    "no-prefix": {"fim_rate": 1.0, "fim_spm_rate": 0.5, "fim_no_prefix": "#"},
    "fragments": {"fim_rate": 0.8, "fim_spm_rate": 0.5, "fim_fragment_rate": 0.5},
}


def megatron_fim_class(checkout: str):
    path = os.path.join(checkout, "megatron", "training", "datasets", "fim_dataset.py")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file; extract it from Megatron-LM (see --help)")
    spec = importlib.util.spec_from_file_location("megatron_fim_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPTFIMDataset


def megatron_reader(cls, transform: FimTransform, tokenizer, sample: np.ndarray):
    """A GPTFIMDataset whose one sample is `sample` (its index arrays say so), with its
    settings and token ids set as its constructor sets them."""
    reader = cls.__new__(cls)
    cfg, t = transform.cfg, transform.tokens
    reader.fim_rate, reader.fim_spm_rate = cfg.fim_rate, cfg.fim_spm_rate
    reader.fragment_fim_rate, reader.no_fim_prefix = cfg.fim_fragment_rate, cfg.fim_no_prefix
    reader.fim_split_sample = t.split
    reader.prefix_tok_id, reader.middle_tok_id, reader.suffix_tok_id = t.prefix, t.middle, t.suffix
    reader.pad_tok_id, reader.eod_tok_id = t.pad, t.eod
    text = plain(tokenizer)
    inner = types.SimpleNamespace(ids_to_text=text.detokenize, text_to_ids=text.tokenize)
    reader.config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(_tokenizer=inner))
    reader.shuffle_index = np.array([0])
    reader.sample_index = np.array([[0, 0], [0, len(sample) - 1]])
    reader.document_index = np.array([0])
    reader.dataset = types.SimpleNamespace(get=lambda i, offset=0, length=None: sample)
    return reader


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("checkout", help="a folder holding megatron/training/datasets/")
    parser.add_argument("--data-path", required=True, help="a preprocessed dataset prefix")
    add_tokenizer_arguments(parser)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--fim-eod-token", default="<|endoftext|>")
    parser.add_argument("--fim-split-sample", default=None, help="for the fragments setting")
    args = parser.parse_args(argv)
    cls = megatron_fim_class(args.checkout)
    tokenizer = build_tokenizer(tokenizer_config(args))
    sources = data_sources([args.data_path], "100,0,0")
    train = build_gpt_datasets(sources, args.seq_length, args.seed, (args.samples, 0, 0))[0]
    failed = 0
    for name, values in SETTINGS.items():
        if name == "fragments" and args.fim_split_sample is None:
            continue
        split = args.fim_split_sample if name == "fragments" else None
        cfg = FimConfig(
            fim_data=True, fim_eod_token=args.fim_eod_token, fim_split_sample=split, **values
        )
        transform = FimTransform(cfg, tokenizer, args.seed)
        equal = changed = 0
        for i in range(args.samples):
            sample = np.asarray(train[i], dtype=np.int64)
            ours = transform(sample, i)
            reader = megatron_reader(cls, transform, tokenizer, sample)
            reader.np_rng = np.random.RandomState([args.seed, i])
            theirs = reader._query_document_sample_shuffle_indices(0)[0]
            equal += bool(np.array_equal(ours, theirs))
            changed += bool(not np.array_equal(ours, sample))
        failed += args.samples - equal
        print(f"{name:10s} {args.samples} samples: {changed} rearranged, {equal} equal")
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
