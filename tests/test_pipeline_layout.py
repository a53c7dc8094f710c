"""--pipeline-model-parallel-layout and --account-for-{embedding,loss}-in-pipeline-split: the
stages the strings describe against megatron-core 0.16.1's PipelineParallelLayerLayout and the
layers its transformer block builds (get_num_layers_to_build, get_transformer_layer_offset),
training under a layout (an embedding-only chunk, MTP beside the loss, virtual stages) equal
to one process, and bad layouts as one-line errors before any rank starts."""

from __future__ import annotations

import pytest

from parallel.errors import ConfigError
from parallel.pipeline.layout import stage_layers
from parallel.pipeline.layout_string import parse_layout, split_counts
from tests.distributed import run_ranks
from tests.requirements import require

LAYOUTS = [  # (string, PP, decoder layers, MTP layers)
    ("Et*2|(tt|)*5t|tmL", 4, 14, 1),  # Megatron-LM's DeepSeek-V3 proxy: PP 4 x virtual 2
    ("Ettt|tttL", 2, 6, 0),
    ("E|t|tt|tmL", 2, 4, 1),
    ("E,t*3|(t|)*2,tL", 2, 6, 0),
    ("EttL", 1, 2, 0),
]


def _megatron_stages(text: str, pp: int) -> list[list[str]]:
    """megatron-core's layout [pp][vpp] as our characters."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    chars = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m",
             LayerType.loss: "L"}  # fmt: skip
    layout = PipelineParallelLayerLayout(text, pp)
    return [["".join(chars[x] for x in stage) for stage in rank] for rank in layout.layout]


@pytest.mark.parametrize("text, pp, layers, mtp", LAYOUTS)
def test_layout_strings_read_as_megatron_core_reads_them(text, pp, layers, mtp):
    require("megatron.core")
    ours = parse_layout(text, pp, layers, mtp)
    theirs = _megatron_stages(text, pp)
    vpp = ours.virtual_size(pp)
    assert vpp == len(theirs[0])
    for rank in range(pp):
        assert [ours.stages[v * pp + rank] for v in range(vpp)] == theirs[rank]
        # the layer numbers each chunk builds, counted in layout order as megatron-core does
        chunks = stage_layers(layers, pp, rank, vpp, counts=ours.counts)
        offset = [sum(s.count("t") for s in ours.stages[: v * pp + rank]) for v in range(vpp)]
        assert chunks == [
            list(range(start, start + theirs[rank][v].count("t"))) for v, start in enumerate(offset)
        ]


def _megatron_split(rank, world, layers, pp, vpp, embedding, loss):
    """megatron-core's layers per (pp rank, virtual stage) and their offsets."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.float32,
    )  # fmt: skip
    out = {}
    for r in range(pp):
        for v in range(vpp):
            stage = v if vpp > 1 else None
            count = get_num_layers_to_build(config, vp_stage=stage, pp_rank=r)
            offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=r)
            out[r, v] = list(range(offset, offset + count))
    return out


@pytest.mark.parametrize(
    "layers, pp, vpp, embedding, loss",
    [(6, 2, 1, True, True), (7, 2, 1, True, False), (7, 4, 1, False, True),
     (10, 2, 2, True, True), (11, 3, 2, True, False)],
)  # fmt: skip
def test_account_for_embedding_and_loss_split_as_megatron_core(layers, pp, vpp, embedding, loss):
    require("megatron.core")
    ((theirs),) = run_ranks(_megatron_split, 1, layers, pp, vpp, embedding, loss)
    counts = split_counts(layers, pp, vpp, embedding, loss)
    for r in range(pp):
        ours = stage_layers(layers, pp, r, vpp, counts=counts)
        assert ours == [theirs[r, v] for v in range(vpp)], (r, ours)


@pytest.mark.parametrize(
    "text, pp, layers, mtp, message",
    [
        ("Ett|tX|L", 3, 3, 0, "'X' is not a layer"),
        ("Ett|ttL", 3, 4, 0, "2 stages do not divide among --pipeline-model-parallel-size 3"),
        ("Ett|tL", 2, 4, 0, "3 't', but the model has --num-layers 4"),
        ("Ett|ttL", 2, 4, 1, "0 'm', but the model has --mtp-num-layers 1"),
        ("tEt|tL", 2, 3, 0, "must begin with E and end with L"),
        ("Ettm|tL", 2, 3, 1, "the MTP layers (m) come after every t"),
        ("Ett|tm|L", 3, 3, 1, "put every m in the last stage, beside the L"),
        ("|Ett|tL", 3, 3, 0, "E must be in the first stage"),
    ],
)
def test_bad_layouts_are_named(text, pp, layers, mtp, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(text, pp, layers, mtp)


def _grads(rank, world, name):
    from parallel.state import ParallelState
    from tests.harness import engine_grads, global_batch, tiny_config

    case = CASES[name]
    cfg = tiny_config("llama", num_layers=case["layers"], mtp_num_layers=case.get("mtp"))
    pp = case.get("pp", 1)
    state = ParallelState.build(pp=pp)
    counts = case.get("counts")
    if "layout" in case:
        counts = parse_layout(case["layout"], pp, cfg.num_layers, cfg.mtp_depths).counts
    vpp = len(counts) // pp if counts else 1
    kind = "interleaved" if vpp > 1 else None
    tokens = global_batch(6, 4, cfg.seq_length)
    _, grads = engine_grads(
        state, cfg, tokens, 1, stage_counts=counts, virtual_size=vpp, schedule_kind=kind
    )
    return grads


CASES = {
    "one": dict(layers=4, mtp=1),
    "one-5": dict(layers=5),
    # rank 0: the embedding alone, then two layers; rank 1: a layer, then a layer, MTP, loss
    "E|t|tt|tmL": dict(layers=4, mtp=1, pp=2, layout="E|t|tt|tmL"),
    "Ett|ttmL": dict(layers=4, mtp=1, pp=2, layout="Ett|ttmL"),
    "account-embedding": dict(layers=5, pp=2, counts=split_counts(5, 2, 1, True, False)),
}


@pytest.mark.parametrize("name", ["E|t|tt|tmL", "Ett|ttmL", "account-embedding"])
def test_training_under_a_layout_matches_one_process(name):
    from tests.harness import compare_params

    reference = "one-5" if CASES[name]["layers"] == 5 else "one"
    (expected,) = run_ranks(_grads, 1, reference)
    for grads in run_ranks(_grads, 2, name):
        assert max(compare_params(grads, expected).values()) < 1e-5, name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--pipeline-model-parallel-layout", "Et|ttL"],
         "3 't', but the model has --num-layers 4"),
        (["--pipeline-model-parallel-layout", "Et|t|ttm|L", "--mtp-num-layers", "1"],
         "put every m in the last stage, beside the L"),
        (["--pipeline-model-parallel-layout", "Ett|ttL", "--num-layers-per-virtual-pipeline-stage",
          "1"], "give one of them"),
        (["--account-for-embedding-in-pipeline-split"],
         "--num-layers 4 + 1 = 5 does not divide into 2 pipeline chunks"),
    ],
)  # fmt: skip
def test_bad_layout_flags_are_one_line_before_any_rank_starts(extra, message):
    from tests.cli import one_line_error, run_forked

    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "3", "--position-embedding-type", "rope",
        "--pipeline-model-parallel-size", "2", *extra,
    ]  # fmt: skip
    # the launcher's main (its command line is run in tests/test_launcher.py)
    error = one_line_error(run_forked("engine.launch", "--nproc-per-node", "2", "-m",
                                      "engine.pretrain", *argv))  # fmt: skip
    assert message in error
