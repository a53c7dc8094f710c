"""engine/data/documents.py against megatron-core 0.16.1's GPTDataset with the same
--reset-position-ids / --reset-attention-mask / --eod-mask-loss: the same position ids, loss
mask and attention mask for every sample of a small corpus (documents of 1 to 20 tokens, so
samples hold several, and one across each sample boundary), for each flag alone and all three;
plus the layouts written out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.data.builder import build_gpt_datasets
from engine.data.documents import document_layout
from engine.data.indexed.dataset import IndexedDatasetBuilder
from engine.data.sources import data_sources
from tests.requirements import require

VOCAB, SEQ, SEED = 5000, 32, 1234
EOD = VOCAB  # megatron-core's null tokenizer's end-of-document id


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("documents") / "docs")
    rng = np.random.default_rng(3)
    with IndexedDatasetBuilder(prefix, np.int32) as writer:
        for _ in range(300):
            body = rng.integers(1, VOCAB, int(rng.integers(1, 20)))
            writer.add_document(np.append(body, EOD))
        writer.finalize()
    return prefix


FLAGS = {
    "reset-position-ids": dict(reset_position_ids=True),
    "reset-attention-mask": dict(reset_attention_mask=True),
    "eod-mask-loss": dict(eod_mask_loss=True),
    "all-three": dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True),
}


@pytest.mark.parametrize("flags", list(FLAGS))
def test_the_same_masks_and_positions_as_megatron_cores_gpt_dataset(prefix, tmp_path, flags):
    require("megatron.core.datasets.helpers_cpp")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    options = FLAGS[flags]
    tokenizer = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=VOCAB
    )
    assert tokenizer.eod == EOD
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=([prefix], None),
        split="1",
        path_to_cache=None,
        tokenizer=tokenizer,
        reset_position_ids=options.get("reset_position_ids", False),
        reset_attention_mask=options.get("reset_attention_mask", False),
        eod_mask_loss=options.get("eod_mask_loss", False),
    )
    count = 200
    [theirs, _, _] = BlendedMegatronDatasetBuilder(
        GPTDataset, [count, 0, 0], lambda: True, config
    ).build()
    [ours, _, _] = build_gpt_datasets(
        data_sources([prefix], "1"), SEQ, SEED, (count, 0, 0), str(tmp_path)
    )
    boundaries = 0
    for i in range(count):
        sample = theirs[i]
        tokens = torch.from_numpy(np.asarray(ours[i], dtype=np.int64))[:-1]
        assert torch.equal(tokens, sample["tokens"]), i
        layout = document_layout(tokens, EOD, **options)
        assert torch.equal(layout.position_ids, sample["position_ids"]), i
        assert torch.equal(layout.loss_mask, sample["loss_mask"]), i
        masked = sample["attention_mask"][0]  # True: may not attend
        assert torch.equal(layout.allowed_attention(), ~masked), i
        boundaries += int((tokens == EOD).sum())
    assert boundaries > 2 * count  # several documents in a sample, on average


def test_layouts_written_out():
    # documents [7 8 EOD] [9 EOD] [5 6 ...: the EOD ends its own document
    tokens = torch.tensor([7, 8, 0, 9, 0, 5, 6])
    layout = document_layout(
        tokens, 0, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    assert layout.document_ids.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert layout.loss_mask.tolist() == [1, 1, 0, 1, 0, 1, 1]
    allowed = layout.allowed_attention()
    assert allowed[6].tolist() == [False] * 5 + [True, True]
    assert allowed[2].tolist() == [True] * 3 + [False] * 4
    plain = document_layout(tokens, 0)  # no flag: one document, plain positions, every loss
    assert plain.document_ids.tolist() == [0] * 7 and plain.position_ids.tolist() == list(range(7))
    assert plain.loss_mask.tolist() == [1.0] * 7
    batched = document_layout(torch.stack([tokens, tokens.flip(0)]), 0, reset_position_ids=True)
    assert batched.position_ids[1].tolist() == [0, 1, 2, 0, 1, 0, 1]  # [6 5 EOD] [9 EOD] [8 7]
