"""Training on packed documents with --reset-position-ids, --reset-attention-mask and
--eod-mask-loss (and --calculate-per-token-loss): every layout (TP2 + SP, CP2 with each comm
type, PP2, DP2) against one process computing the same loss with explicit per-sample
positions, documents and masks; and the second of two packed documents gets the logits it has
alone."""

from __future__ import annotations

import pytest
import torch

from engine.data.documents import Packing
from engine.model import BuildContext, GPTModel
from engine.train.step import shared_loss
from parallel.state import ParallelState
from tests.distributed import rel_err, run_ranks
from tests.harness import compare_params, engine_grads, global_batch, tiny_config

EOD = 7
MBS = 2
PACKING = Packing(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def packed_tokens(step: int, size: int, seq: int) -> torch.Tensor:
    """A global batch with EOD tokens planted: one sample a single document, one ending in
    EOD (its next document empty), the rest documents of random lengths, some across the CP
    chunk boundaries."""
    tokens = global_batch(step, size, seq)
    tokens[tokens == EOD] = EOD + 1
    gen = torch.Generator().manual_seed(100 + step)
    planted = torch.rand(tokens.shape, generator=gen) < 0.15
    tokens[planted] = EOD
    tokens[0] = torch.where(tokens[0] == EOD, EOD + 1, tokens[0])
    tokens[1, seq - 1] = EOD  # the last input token ends a document
    return tokens


def reference(cfg, tokens, per_token: bool):
    """One process: the reported loss (as Megatron-LM's: all tokens' summed loss over their
    count) and the gradients of what is differentiated (each micro-batch's masked mean,
    averaged; or that same global loss with --calculate-per-token-loss)."""
    model = GPTModel(cfg, BuildContext(cfg, seed=1234))
    sums, counts, means = [], [], []
    for piece in tokens.split(MBS):
        batch = PACKING.annotate({"tokens": piece[:, :-1], "labels": piece[:, 1:]})
        per = model(
            batch["tokens"],
            batch["labels"],
            position_ids=batch["position_ids"],
            document_ids=batch["document_ids"],
        )
        mask = batch["loss_mask"]
        sums.append((per * mask).sum())
        counts.append(mask.sum())
        means.append(sums[-1] / counts[-1])
    reported = sum(sums) / sum(counts)
    loss = reported if per_token else torch.stack(means).mean()
    loss.backward()
    return reported.item(), {n: p.grad for n, p in model.named_parameters()}


LAYOUTS = {
    # name: (tp, pp, cp, comm type, style, per-token loss)
    "tp2-sp": (2, 1, 1, "p2p", "gpt2", True),
    "cp2-p2p": (1, 1, 2, "p2p", "llama", True),
    "cp2-a2a": (1, 1, 2, "a2a", "llama", True),
    "cp2-allgather": (1, 1, 2, "allgather", "llama", True),
    "pp2": (1, 2, 1, "p2p", "llama", True),
    "dp2": (1, 1, 1, "p2p", "llama", True),
    "dp2-mean-per-micro-batch": (1, 1, 1, "p2p", "llama", False),
}


def _layouts(rank, world, names):
    out = {}
    for name in names:
        tp, pp, cp, comm_type, style, per_token = LAYOUTS[name]
        state = ParallelState.build(tp=tp, pp=pp, cp=cp)
        cfg = tiny_config(style)
        tokens = packed_tokens(3, MBS * 2 * state.dp_size, cfg.seq_length)
        ref_loss, ref_grads = reference(cfg, tokens, per_token)
        losses, grads = engine_grads(
            state,
            cfg,
            tokens,
            MBS,
            cp_comm_type=(comm_type,),
            sequence_parallel=tp > 1,
            packing=PACKING,
            per_token_loss=per_token,
        )
        loss = shared_loss(losses, state)[0]
        out[name] = {
            "loss": abs(loss - ref_loss),
            "grad": max(compare_params(grads, ref_grads).values()),
            "params": len(grads),
        }
    return out


@pytest.mark.parametrize(
    "names",
    [["tp2-sp", "cp2-p2p", "cp2-a2a"], ["cp2-allgather", "pp2", "dp2", "dp2-mean-per-micro-batch"]],
)
def test_packed_documents_every_layout_matches_one_process(names):
    for rank, results in enumerate(run_ranks(_layouts, 2, names)):
        for name, result in results.items():
            assert result["loss"] < 1e-5, (rank, name, result)
            assert result["grad"] < 1e-5, (rank, name, result)
            assert result["params"] > 0, (rank, name)


def test_flags_change_the_loss():
    """The reference itself: each flag changes what is trained (none is silently ignored).
    Learned positions: under RoPE a position reset moves only pairs of tokens of different
    documents relative to each other."""
    cfg = tiny_config("gpt2")
    tokens = packed_tokens(3, 4, cfg.seq_length)
    model = GPTModel(cfg, BuildContext(cfg, seed=1234))
    plain = model(tokens[:, :-1], tokens[:, 1:]).mean().item()
    for flags in ({"reset_position_ids": True}, {"reset_attention_mask": True}):
        batch = Packing(EOD, **flags).annotate({"tokens": tokens[:, :-1]})
        per = model(
            tokens[:, :-1],
            tokens[:, 1:],
            position_ids=batch.get("position_ids"),
            document_ids=batch.get("document_ids"),
        )
        assert abs(per.mean().item() - plain) > 1e-4, flags


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_second_document_has_the_logits_it_has_alone(style):
    """A sample of two documents, with --reset-attention-mask --reset-position-ids: the second
    document's logits equal those of a sample holding only it; without the flags they differ."""
    cfg = tiny_config(style)
    model = GPTModel(cfg, BuildContext(cfg, seed=5)).eval()
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(EOD + 1, 300, (6,), generator=gen)
    second = torch.randint(EOD + 1, 300, (cfg.seq_length - 7,), generator=gen)
    tokens = torch.cat([first, torch.tensor([EOD]), second])[None]
    packing = Packing(EOD, reset_position_ids=True, reset_attention_mask=True)
    batch = packing.annotate({"tokens": tokens})
    with torch.no_grad():
        packed = model.full_logits(
            model(
                tokens,
                position_ids=batch["position_ids"],
                document_ids=batch["document_ids"],
            )
        )[0, 7:]
        alone = model.full_logits(model(second[None]))[0]
        unmasked = model.full_logits(model(tokens))[0, 7:]
    assert rel_err(packed, alone) < 1e-6
    assert rel_err(unmasked, alone) > 1e-3


@pytest.fixture(scope="module")
def short_documents(corpus, tokenizer_model, tmp_path_factory) -> str:
    """The corpus cut into documents of a few lines (tens of tokens: several per sample),
    preprocessed with an EOD after each."""
    import json

    from engine.data.prepare.preprocess import preprocess

    folder = tmp_path_factory.mktemp("short")
    path = folder / "short.jsonl"
    with open(corpus["jsonl"]) as source, open(path, "w") as out:
        for k, line in enumerate(source):
            lines = [x for x in json.loads(line)["text"].splitlines() if x.strip()]
            for start in range(0, min(len(lines), 60), 3):
                out.write(json.dumps({"text": "\n".join(lines[start : start + 3])}) + "\n")
            if k > 40:
                break
    preprocess(str(path), str(folder / "data"), tokenizer_model, append_eod=True, progress=False)
    return str(folder / "data_text_document")


def test_training_with_the_flags_through_pretrain(short_documents, tokenizer_model, tmp_path):
    """engine.pretrain with the three flags and --calculate-per-token-loss: PP 4 (every stage
    reads the batches, for their positions and documents) trains PP 1's losses, which differ
    from those of the same run without the flags."""
    from tests.test_training import _pretrain_counting_reads, base_args, losses

    flags = {
        "--reset-position-ids": True,
        "--reset-attention-mask": True,
        "--eod-mask-loss": True,
        "--calculate-per-token-loss": True,
    }
    common = {"--hidden-dropout": "0.0", "--attention-dropout": "0.0", "--train-iters": "3"}
    common |= {"--seq-length": "64"}
    logs = {}
    for name, pp, extra in (("plain", 1, {}), ("pp1", 1, flags), ("pp4", 4, flags)):
        log = str(tmp_path / f"{name}.jsonl")
        more = {"--pipeline-model-parallel-size": str(pp), "--log-jsonl": log}
        argv = base_args(short_documents, tokenizer_model, **common, **more, **extra)
        reads = run_ranks(_pretrain_counting_reads, pp, argv, timeout=300)
        logs[name] = losses(log)
    assert all(count > 0 for count in reads), reads
    assert sorted(logs["pp4"]) == [1, 2, 3]
    for iteration, loss in logs["pp1"].items():
        assert abs(logs["pp4"][iteration] - loss) / loss < 1e-5, (logs, iteration)
    assert abs(logs["plain"][1] - logs["pp1"][1]) > 1e-4, logs


def _segments(ids, eod: int) -> list[tuple[list[int], bool, bool]]:
    """A sample's documents: (tokens without the EOD, starts after an EOD, ends with one)."""
    out, start = [], 0
    ids = [int(t) for t in ids]
    for k, token in enumerate(ids):
        if token == eod:
            out.append((ids[start:k], start > 0, True))
            start = k + 1
    if start < len(ids):
        out.append((ids[start:], start > 0, False))
    return out


def test_parquet_and_indexed_samples_cut_documents_at_the_same_places(
    short_documents, tokenizer_model, tmp_path, capsys
):
    """The same documents preprocessed (.bin/.idx) and streamed from Parquet: in the samples of
    both, every document that starts after an EOD is the start of a source document and every
    one ending in EOD is a source document's end; tools/show_samples.py marks those starts and
    the predictions --eod-mask-loss leaves without loss."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.config.tokenizer import TokenizerConfig
    from engine.data.builder import build_gpt_datasets, build_streaming_datasets
    from engine.data.sources import data_sources
    from engine.data.tokenizers import build_tokenizer
    from tools import show_samples

    config = TokenizerConfig(tokenizer_model=tokenizer_model)
    tokenizer = build_tokenizer(config)
    source = short_documents.replace("data_text_document", "short.jsonl")
    with open(source) as f:
        texts = [json.loads(line)["text"] for line in f]
    pq.write_table(pa.table({"text": texts}), tmp_path / "short.parquet")
    documents = [tuple(ids) for ids in tokenizer.tokenize_batch(texts)]
    seq, count = 64, 12
    indexed = build_gpt_datasets(data_sources([short_documents], "100,0,0"), seq, 1, (count, 0, 0))[
        0
    ]
    sources = data_sources([str(tmp_path / "short.parquet")], "100,0,0", data_format="parquet")
    stream = build_streaming_datasets(sources, "text", 64, seq, 1, (count, 0, 0), config)[0]
    batches = stream.iterator(0, 1, 0, 1)
    streamed = [show_samples._sample(next(batches)) for _ in range(count)]
    for name, samples in (("indexed", [indexed[i] for i in range(count)]), ("parquet", streamed)):
        starts = ends = 0
        for ids in samples:
            for tokens, after_eod, ends_in_eod in _segments(ids, tokenizer.eod):
                if after_eod:
                    starts += 1
                    assert any(d[: len(tokens)] == tuple(tokens) for d in documents), name
                if ends_in_eod:
                    ends += 1
                    assert any(d[len(d) - len(tokens) :] == tuple(tokens) for d in documents), name
        assert starts > count // 2 and ends > count // 2, (name, starts, ends)
    argv = ["--data-path", short_documents, "--tokenizer-model", tokenizer_model, "--split"]
    argv += ["100,0,0", "--seq-length", str(seq), "--seed", "1", "--num-samples", "1"]
    assert show_samples.main([*argv, "--by-document", "--eod-mask-loss"]) == 0
    printed = capsys.readouterr().out
    ids = [int(t) for t in indexed[0]]
    eods = [k for k, t in enumerate(ids[:-1]) if t == tokenizer.eod]
    starts = [0] + [k + 1 for k in eods]
    assert f"documents start at tokens {', '.join(map(str, starts))}" in printed
    assert f"no loss on the predictions made at tokens {', '.join(map(str, eods))}" in printed
    assert printed.count("[document ") == len(starts)


def test_evaluation_reads_windows_as_training_read_samples(
    short_documents, tokenizer_model, tmp_path
):
    """A checkpoint trained with the three flags records them; tools/evaluate.py's perplexity
    then scores each window's documents as if each were alone (the independent reference:
    every document's tokens run through the model on their own, positions from 0) and leaves
    out the predictions made at EOD tokens."""
    import json

    from engine.eval.loading import load_model
    from engine.eval.perplexity import windows
    from tests.cli import run_tool
    from tests.test_training import base_args

    flags = {"--reset-position-ids": True, "--reset-attention-mask": True}
    flags |= {"--eod-mask-loss": True, "--seq-length": "64", "--train-iters": "3"}
    ckpt = str(tmp_path / "ckpt")
    argv = base_args(short_documents, tokenizer_model, **flags, **{"--save": ckpt})
    run_ranks(_pretrain, 1, argv, timeout=300)
    out = tmp_path / "eval.json"
    result = run_tool(
        "evaluate.py", "--load", ckpt, "--perplexity-data", short_documents,
        "--perplexity-windows", "3", "--output-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["packing"]["reset_attention_mask"] and found["packing"]["eod_mask_loss"]
    model, tokenizer, _ = load_model(ckpt)
    eod, total, count = tokenizer.eod, 0.0, 0
    for window in windows(short_documents, 64, 3):
        start = 0
        for k, token in enumerate(window[:-1]):
            last = k == len(window) - 2
            if token == eod or last:  # a document's inputs end here (with its EOD)
                piece = window[start : k + 2]  # its inputs and the tokens they predict
                with torch.no_grad():
                    logits = model.full_logits(model(torch.tensor([piece[:-1]])))[0].double()
                logprobs = torch.log_softmax(logits, -1)[range(len(piece) - 1), piece[1:]]
                keep = torch.tensor(piece[:-1]) != eod
                total -= float(logprobs[keep].sum())
                count += int(keep.sum())
                start = k + 1
    assert found["perplexity"]["tokens"] == count
    assert found["perplexity"]["nll"] == pytest.approx(total / count, rel=1e-9)


def _pretrain(rank, world, argv):
    from engine.pretrain import main

    return main(argv)


MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=24,
    moe_aux_loss_coeff=[0.1],
    moe_z_loss_coeff=0.1,
)


def _moe_per_token(rank, world):
    state = ParallelState.build(tp=1)
    cfg = tiny_config("llama", **MOE)
    tokens = packed_tokens(4, MBS * 2 * state.dp_size, cfg.seq_length)
    losses, grads = engine_grads(state, cfg, tokens, MBS, packing=PACKING, per_token_loss=True)
    return shared_loss(losses, state)[0], {k: v.clone() for k, v in grads.items()}


def test_per_token_loss_scales_the_moe_losses_as_megatron_core():
    """--calculate-per-token-loss with MoE, as megatron-core 0.16.1 computes it: its router
    multiplies each MoE loss by the tokens it routed (router.py, "Scale the aux_loss by the
    number of tokens"), and finalize_model_grads divides every gradient by the global batch's
    token count. DP 2 against one process that differentiates exactly that: each micro-batch's
    MoE losses times MBS x seq over the count."""
    cfg = tiny_config("llama", **MOE)
    tokens = packed_tokens(4, MBS * 2 * 2, cfg.seq_length)
    model = GPTModel(cfg, BuildContext(cfg, seed=1234))
    batches = [
        PACKING.annotate({"tokens": t[:, :-1], "labels": t[:, 1:]}) for t in tokens.split(MBS)
    ]
    count = sum(b["loss_mask"].sum() for b in batches)
    model.ctx.moe_loss_scale.step_factor = MBS * cfg.seq_length / float(count)
    total = 0.0
    for b in batches:
        per = model(
            b["tokens"],
            b["labels"],
            position_ids=b["position_ids"],
            document_ids=b["document_ids"],
        )
        loss = (per * b["loss_mask"]).sum() / count
        loss.backward()
        total += loss.item()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for loss, grads in run_ranks(_moe_per_token, 2):
        assert abs(loss - total) < 1e-5
        assert max(compare_params(grads, expected).values()) < 1e-5
