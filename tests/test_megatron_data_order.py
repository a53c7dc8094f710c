"""The same samples in the same order as Megatron-LM: our train/valid/test datasets against
megatron-core 0.16.1's own BlendedMegatronDatasetBuilder (GPTDataset, BlendedDataset,
MockGPTDataset) run here on CPU over the same .bin/.idx files, compared token for token."""

from __future__ import annotations

import types

import numpy as np
import pytest

from engine.config.configs import Configs
from engine.config.evaluation import EvalConfig
from engine.config.training import TrainingConfig
from engine.data.builder import build_gpt_datasets, build_mock_datasets
from engine.data.indexed.dataset import IndexedDataset, IndexedDatasetBuilder
from engine.data.sources import data_sources
from engine.train.datasets import split_sample_counts
from tests.requirements import require

EOD = 0
SEQ = 32


@pytest.fixture(scope="module")
def megatron():
    require("megatron.core.datasets.helpers_cpp")
    from megatron.core.datasets import blended_megatron_dataset_builder as builder
    from megatron.core.datasets import gpt_dataset
    from megatron.core.tokenizers import MegatronTokenizer

    # Their datasets read only the end-of-document and pad ids of it (for masks we turn off).
    tokenizer = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=5000
    )
    return types.SimpleNamespace(builder=builder, gpt=gpt_dataset, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    """Four datasets of different sizes and document lengths (573 documents for the first,
    the corpus size that once split one document off with --split 949,50,1)."""
    root = tmp_path_factory.mktemp("order")
    rng = np.random.default_rng(5)
    out = []
    for name, docs, longest in (("a", 573, 60), ("b", 211, 200), ("c", 97, 25), ("d", 40, 90)):
        prefix = str(root / name)
        with IndexedDatasetBuilder(prefix, np.int32) as writer:
            for _ in range(docs):
                body = rng.integers(1, 5000, int(rng.integers(1, longest)))
                writer.add_document(np.append(body, EOD))
            writer.finalize()
        out.append(prefix)
    return out


def _theirs(megatron, sizes, seed, blend=None, split=None, per_split=None, mock=False):
    config = megatron.gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=SEQ,
        blend=blend,
        blend_per_split=per_split,
        split=split,
        # No cache folder: their BlendedDataset consults torch.distributed when given one.
        # Their GPTDatasets then cache under <prefix>/cache/, beside our test files.
        path_to_cache=None,
        tokenizer=megatron.tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    cls = megatron.gpt.MockGPTDataset if mock else megatron.gpt.GPTDataset
    return megatron.builder.BlendedMegatronDatasetBuilder(
        cls, list(sizes), lambda: True, config
    ).build()


def _megatron_blend(data_path):
    """--data-path as Megatron-LM's get_blend_from_list turns it into a blend."""
    from megatron.core.datasets.utils import get_blend_from_list

    return get_blend_from_list(data_path)


def _assert_same_samples(ours, theirs, sizes):
    for k, (mine, their) in enumerate(zip(ours, theirs, strict=True)):
        assert (mine is None) == (their is None), f"split {k}"
        if mine is None:
            continue
        assert len(mine) >= sizes[k] and len(their) >= sizes[k]
        count = min(len(mine), len(their))
        for i in range(count):
            sample = their[i]
            tokens = mine[i]
            np.testing.assert_array_equal(tokens[:-1], sample["tokens"].numpy(), f"{k}:{i}")
            np.testing.assert_array_equal(tokens[1:], sample["labels"].numpy(), f"{k}:{i}")


def _sizes(train_iters, global_batch, eval_interval, eval_iters):
    cfg = Configs(
        training=TrainingConfig(train_iters=train_iters),
        evaluation=EvalConfig(eval_interval=eval_interval, eval_iters=eval_iters),
    )
    return split_sample_counts(cfg, global_batch)


CASES = {
    # one prefix, the split; the train split spans three epochs (533 samples each) and
    # its last one, under 80% of an epoch, is shuffled apart; so is the valid split's
    "single": (lambda p: [p[0]], "949,50,1", (93, 12, 20, 2)),
    # the same with a last epoch of over 80%, kept in the shuffle
    "single-full-last-epoch": (lambda p: [p[0]], "949,50,1", (87, 18, 200, 1)),
    "weighted": (lambda p: ["0.5", p[0], "0.3", p[1], "0.2", p[2]], "90,8,2", (40, 8, 10, 3)),
    "weighted-one": (lambda p: ["1.0", p[1]], "98,2,0", (30, 4, 10, 2)),
    "by-size": (lambda p: [p[0], p[1], p[2]], "80,15,5", (10, 8, 5, 1)),
    "integer-weights": (lambda p: ["30", p[3], "70", p[0]], "1", (25, 4, 100, 0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_path_and_split_give_megatrons_samples(megatron, prefixes, tmp_path, case):
    paths_of, split, run = CASES[case]
    data_path = paths_of(prefixes)
    sizes = _sizes(*run)
    seed = 1234
    ours = build_gpt_datasets(
        data_sources(data_path, split), SEQ, seed, sizes, str(tmp_path / "ours")
    )
    theirs = _theirs(megatron, sizes, seed, blend=_megatron_blend(data_path), split=split)
    _assert_same_samples(ours, theirs, sizes)
    if case.startswith("single"):
        assert ours[0].datasets[0].num_epochs == 3  # the case covers what it says


def test_per_split_paths_give_megatrons_samples(megatron, prefixes, tmp_path):
    # A split's only prefix is taken as it is, weighted or not: asked for exactly one epoch of
    # samples, it must not get the 0.5% surplus of a blend (that would be a second epoch).
    per_split = (["0.6", prefixes[0], "0.4", prefixes[1]], [prefixes[2]], ["1.0", prefixes[3]])
    tokens = int(IndexedDataset(prefixes[3]).sequence_lengths.sum())
    sizes = (160, 48, (tokens - 1) // SEQ)
    sources = data_sources(None, "", per_split)
    ours = build_gpt_datasets(sources, SEQ, 7, sizes, str(tmp_path / "ours"))
    theirs = _theirs(
        megatron,
        sizes,
        7,
        per_split=[_megatron_blend(p) if p else None for p in per_split],
    )
    _assert_same_samples(ours, theirs, sizes)


def test_mock_data_gives_megatrons_samples(megatron, tmp_path):
    sizes = _sizes(10, 8, 5, 1)
    tokenizer = megatron.tokenizer
    ours = build_mock_datasets(tokenizer.vocab_size, tokenizer.eod, SEQ, 3, sizes)
    theirs = _theirs(megatron, sizes, 3, mock=True)
    _assert_same_samples(ours, theirs, sizes)
