"""Training straight from Parquet: windows tokenized and packed like preprocessed data, an order
that depends on neither worker count nor data-parallel size, exact resume, blending, epochs,
and one-line errors for bad shards."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config.tokenizer import TokenizerConfig
from engine.data.builder import build_streaming_datasets
from engine.data.indexed.dataset import IndexedDataset
from engine.data.sources import data_sources, detect_format
from engine.data.streaming.shards import open_shards
from engine.data.tokenizers import build_tokenizer
from engine.errors import ConfigError, InputError
from tests.cli import one_line_error, run_python
from tests.test_training import base_args, losses, pretrain

SEQ = 32
WINDOW = 5


@pytest.fixture(scope="module")
def shards(corpus, tmp_path_factory) -> str:
    """The corpus as three shards with small row groups (windows straddle row groups)."""
    folder = tmp_path_factory.mktemp("shards")
    table = pq.read_table(corpus["parquet"])
    bounds = [0, 17, 30, table.num_rows]
    for i in range(3):
        part = table.slice(bounds[i], bounds[i + 1] - bounds[i])
        pq.write_table(part, folder / f"part-{i}.parquet", row_group_size=3)
    return str(folder)


def _datasets(path, tokenizer_model, num_samples=(400, 40, 0), split="90,10,0", **kw):
    data_path = path if isinstance(path, list) else [path]
    return build_streaming_datasets(
        data_sources(data_path, split),
        kw.get("column", "text"),
        kw.get("window", WINDOW),
        SEQ,
        kw.get("seed", 1234),
        num_samples,
        kw.get("tokenizer", TokenizerConfig(tokenizer_model=tokenizer_model)),
    )


def _global_order(dataset, count, micro_batch_size=2, dp_size=1, workers=0, state=None, start=0):
    """`count` samples of the global order, gathered from every DP rank's micro-batches."""
    iterators = [
        dataset.iterator(start, micro_batch_size, r, dp_size, workers, state)
        for r in range(dp_size)
    ]
    out = []
    while len(out) < count:
        for it in iterators:
            batch = next(it)
            tokens = batch["tokens"].numpy()
            labels = batch["labels"].numpy()
            out.extend(np.concatenate([tokens, labels[:, -1:]], axis=1))
    return np.stack(out[:count]), iterators


def test_windows_hold_the_preprocessed_documents_packed(
    shards, tokenizer_model, dataset_prefix, corpus
):
    """Each window's samples are its rows' tokens, each followed by EOD, cut into seq_length + 1
    samples overlapping by one token: the very documents preprocess_data.py writes."""
    train = _datasets(shards, tokenizer_model, split="100,0,0")[0]
    plan = train.plans[0]
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tokenizer_model))
    indexed = IndexedDataset(dataset_prefix)
    texts = pq.read_table(corpus["parquet"]).column("text").to_pylist()
    offsets = {"part-0.parquet": 0, "part-1.parquet": 17, "part-2.parquet": 30}
    epoch_orders: dict = {}
    stream = train.iterator(0, 1, 0, 1).streams[0]
    seen = set()
    for k in range(plan.windows_per_epoch):
        shard, start, stop = plan.window_rows_of(k, epoch_orders)
        seen.add((shard.name, start))
        first = offsets[shard.name] + start
        tokens = []
        for row in range(first, offsets[shard.name] + stop):
            ids = indexed.get(row).tolist()
            assert ids == tokenizer.tokenize(texts[row]) + [tokenizer.eod]
            tokens.extend(ids)
        expected = [
            tuple(tokens[i * SEQ : i * SEQ + SEQ + 1]) for i in range((len(tokens) - 1) // SEQ)
        ]
        got = [tuple(stream.next()) for _ in range(len(expected))]
        assert got != expected or len(expected) < 3  # shuffled inside the window
        assert Counter(got) == Counter(expected)
    assert len(seen) == plan.windows_per_epoch == 4 + 3 + 5


def test_order_is_independent_of_worker_count(shards, tokenizer_model):
    train = _datasets(shards, tokenizer_model)[0]
    reference, _ = _global_order(train, 150, workers=0)
    for workers in (1, 2):
        order, _ = _global_order(train, 150, workers=workers)
        assert np.array_equal(order, reference), workers


def test_resume_under_another_dp_size_continues_the_global_order(shards, tokenizer_model, tmp_path):
    train = _datasets(shards, tokenizer_model)[0]
    reference, _ = _global_order(train, 200, micro_batch_size=2, dp_size=1)
    head, iterators = _global_order(train, 72, micro_batch_size=4, dp_size=2)
    assert np.array_equal(head, reference[:72])
    state = json.loads(json.dumps(iterators[0].state_dict()))  # as a checkpoint stores it
    assert state == iterators[1].state_dict()  # every rank holds the same position
    for dp, mbs in ((1, 2), (4, 1), (2, 4)):
        tail, _ = _global_order(train, 128, mbs, dp, workers=1, state=state, start=72)
        assert np.array_equal(tail, reference[72:200]), (dp, mbs)
    # A position belongs to its data and settings; anything else is refused.
    for changed in (
        _datasets(shards, tokenizer_model, window=WINDOW + 1)[0],
        _datasets(shards, tokenizer_model, seed=7)[0],
        _datasets(os.path.join(shards, "part-1.parquet"), tokenizer_model)[0],
    ):
        with pytest.raises(ConfigError, match="belongs to other shards or settings") as err:
            changed.iterator(72, 2, 0, 1, 0, state)
        assert err.value.every_rank  # every rank refuses alike: rank 0 says it once
    with pytest.raises(ConfigError, match="belongs to other shards or settings"):
        other = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=4000)
        _datasets(shards, None, tokenizer=other)[0].iterator(72, 2, 0, 1, 0, state)
    # The tokenizer is known by what it does, not by its path: moved, it resumes.
    moved = shutil.copy(tokenizer_model, tmp_path / "moved.model")
    tail, _ = _global_order(_datasets(shards, str(moved))[0], 128, 2, 1, state=state, start=72)
    assert np.array_equal(tail, reference[72:200])
    with pytest.raises(ConfigError, match="the checkpoint is inconsistent"):
        train.iterator(80, 2, 0, 1, 0, state)
    with pytest.raises(ConfigError, match="holds no Parquet stream position"):
        train.iterator(72, 2, 0, 1, 0, None)


def test_splits_take_disjoint_rows_of_each_window(shards, tokenizer_model):
    train, valid, _ = _datasets(shards, tokenizer_model, split="60,40,0", window=10)
    orders: dict = {}
    for k in range(train.plans[0].windows_per_epoch):
        shard, a, b = train.plans[0].window_rows_of(k, orders)
        other, c, d = valid.plans[0].window_rows_of(k, {})
        assert shard == other and a < b == c < d and (d - a) in (10, shard.num_rows % 10)


def test_epochs_reshuffle_shards_and_repeat_the_same_samples(corpus, tokenizer_model, tmp_path):
    texts = [t[:600] for t in pq.read_table(corpus["parquet"]).column("text").to_pylist()]
    for i in range(4):
        pq.write_table(pa.table({"text": texts[i::4]}), tmp_path / f"{i}.parquet")
    train = _datasets(str(tmp_path), tokenizer_model, num_samples=(4000, 40, 0))[0]
    plan = train.plans[0]
    orders: dict = {}
    firsts = [plan.window_rows_of(e * plan.windows_per_epoch, orders)[0].name for e in range(6)]
    assert len(set(firsts)) > 1  # shard order is redrawn every epoch
    order, iterators = _global_order(train, 2000)
    assert iterators[0].streams[0].window >= 2 * plan.windows_per_epoch
    first_epoch = []
    stream = train.iterator(0, 1, 0, 1).streams[0]
    while True:
        sample = stream.next()
        if stream.window >= plan.windows_per_epoch:
            break
        first_epoch.append(tuple(sample))
    n = len(first_epoch)
    second_epoch = [tuple(s) for s in order[n : 2 * n]]
    assert Counter(second_epoch) == Counter(first_epoch)
    assert second_epoch != first_epoch


def test_blend_follows_weights_and_resumes_per_source(shards, corpus, tokenizer_model, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(corpus["parquet"], other / "all.parquet")
    blend = _datasets(["0.7", shards, "0.3", str(other)], tokenizer_model, window=4)[0]
    alone = [_datasets(p, tokenizer_model, window=4)[0] for p in (shards, str(other))]
    order, iterators = _global_order(blend, 300)
    expected_a, _ = _global_order(alone[0], 300)
    expected_b, _ = _global_order(alone[1], 300)
    which = blend.which[:300]
    assert abs(np.mean(which == 0) - 0.7) < 0.01
    assert np.array_equal(order[which == 0], expected_a[: int(np.sum(which == 0))])
    assert np.array_equal(order[which == 1], expected_b[: int(np.sum(which == 1))])
    state = iterators[0].state_dict()
    assert len(state["positions"]) == 2
    more, _ = _global_order(blend, 50, state=state, start=300)
    full, _ = _global_order(blend, 350)
    assert np.array_equal(more, full[300:])


def test_data_format_is_detected_and_mixing_is_refused(shards, dataset_prefix, tmp_path):
    assert detect_format([shards], None) == "parquet"
    assert detect_format([os.path.join(shards, "part-0.parquet")], None) == "parquet"
    assert detect_format([dataset_prefix], None) == "indexed"
    os.makedirs(os.path.join(tmp_path, "cached"), exist_ok=True)  # megatron-core's cache folder
    for suffix in (".bin", ".idx"):
        shutil.copy(dataset_prefix + suffix, os.path.join(tmp_path, "cached" + suffix))
    assert detect_format([os.path.join(tmp_path, "cached")], None) == "indexed"
    with pytest.raises(ConfigError, match="mixes Parquet"):
        detect_format(["0.5", shards, "0.5", dataset_prefix], None)


def _bad_shard(folder, name, table, **kw):
    folder.mkdir(exist_ok=True)
    path = folder / name
    pq.write_table(table, path, **kw)
    return str(path)


def test_bad_shards_are_named_with_their_row(tmp_path, tokenizer_model):
    with pytest.raises(InputError, match=r"no column 'text' \(columns: body\)"):
        open_shards(_bad_shard(tmp_path / "a", "x.parquet", pa.table({"body": ["hi"]})), "text")
    with pytest.raises(InputError, match="holds int64, not text"):
        open_shards(_bad_shard(tmp_path / "b", "x.parquet", pa.table({"text": [1]})), "text")
    cut = _bad_shard(tmp_path / "c", "x.parquet", pa.table({"text": ["hello world"] * 50}))
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) - 20)
    with pytest.raises(InputError, match=r"c/x.parquet: not a Parquet file, or truncated"):
        open_shards(cut, "text")
    no_rows = _bad_shard(tmp_path / "e", "x.parquet", pa.table({"text": pa.array([], pa.string())}))
    with pytest.raises(InputError, match="its Parquet files hold no rows"):
        open_shards(no_rows, "text")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="a folder with no .parquet files"):
        open_shards(str(tmp_path / "empty"), "text")
    # Damage inside a data page (the footer intact) shows only when the rows are read.
    texts = [f"document {i} " * 40 for i in range(400)]
    damaged = _bad_shard(
        tmp_path / "d",
        "x.parquet",
        pa.table({"text": texts}),
        row_group_size=100,
        compression="snappy",
        use_dictionary=False,
    )
    _damage_row_group(damaged, 2)
    train = _datasets(
        str(tmp_path / "d"), tokenizer_model, (10**5, 0, 0), window=50, split="100,0,0"
    )[0]
    with pytest.raises(InputError, match=r"d/x.parquet: rows from 200 on are unreadable") as err:
        _global_order(train, 10**6, workers=2)
    assert err.value.every_rank and "\n" not in str(err.value)


def _damage_row_group(path: str, group: int) -> None:
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = column.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start + 20)  # inside the first page's compressed data
        f.write(b"\x00" * 30)


def _parquet_args(shards, tokenizer_model, **extra):
    return base_args(
        shards,
        tokenizer_model,
        **{
            "--train-iters": "8",
            "--global-batch-size": "4",
            "--parquet-shuffle-buffer": "10",  # the valid split gets 1 row of each window
            "--eval-interval": "3",
            **extra,
        },
    )


def test_training_resumes_bit_exact_and_under_another_dp_size(shards, tokenizer_model, tmp_path):
    """Uninterrupted with 2 loader workers; saved at 3 and resumed with none: the same floats
    (with dropout on, so a loader drawing from the global RNG would show). Resumed under DP=1
    and DP=2 from the same checkpoint without dropout (its masks depend on the layout): the
    same samples, so the same losses to rounding."""
    ckpt = str(tmp_path / "ckpt")
    straight = tmp_path / "straight.jsonl"
    # DataLoader workers need a non-daemonic process: the command line, as torchrun runs it.
    args = _parquet_args(
        shards, tokenizer_model, **{"--log-jsonl": str(straight), "--num-workers": "2"}
    )
    result = run_python("-m", "engine.pretrain", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    pretrain(
        1,
        _parquet_args(
            shards,
            tokenizer_model,
            **{
                "--log-jsonl": str(tmp_path / "a.jsonl"),
                "--save": ckpt,
                "--save-interval": "3",
                "--exit-interval": "3",
            },
        ),
    )
    pretrain(
        1,
        _parquet_args(
            shards, tokenizer_model, **{"--log-jsonl": str(tmp_path / "b.jsonl"), "--load": ckpt}
        ),
    )
    expected = losses(straight)
    assert sorted(expected) == list(range(1, 9))
    assert losses(tmp_path / "a.jsonl") | losses(tmp_path / "b.jsonl") == expected
    no_dropout = {"--load": ckpt, "--hidden-dropout": "0", "--attention-dropout": "0"}
    for world, mbs in ((1, "2"), (2, "1")):
        log = str(tmp_path / f"dp{world}.jsonl")
        extra = {**no_dropout, "--log-jsonl": log, "--micro-batch-size": mbs}
        pretrain(world, _parquet_args(shards, tokenizer_model, **extra))
    dp1, dp2 = losses(tmp_path / "dp1.jsonl"), losses(tmp_path / "dp2.jsonl")
    assert sorted(dp2) == sorted(dp1) == list(range(4, 9))
    for iteration, loss in dp2.items():
        assert loss == pytest.approx(dp1[iteration], rel=1e-5), iteration


def test_bad_rows_and_columns_stop_the_run_with_one_line(shards, tokenizer_model, tmp_path):
    nulls = tmp_path / "nulls"
    _bad_shard(
        nulls,
        "x.parquet",
        pa.table({"text": ["def f():\n    return 1\n" * 40] * 3 + [None] + ["x = 1\n"] * 10}),
    )
    # Read (in the first window) by a DataLoader worker process.
    args = _parquet_args(str(nulls), tokenizer_model, **{"--num-workers": "2"})
    line = one_line_error(run_python("-m", "engine.pretrain", *args))
    assert "x.parquet: row 3: the text is null" in line
    args = _parquet_args(shards, tokenizer_model, **{"--parquet-text-column": "body"})
    line = one_line_error(run_python("-m", "engine.pretrain", *args))
    assert "part-0.parquet: no column 'body'" in line and "--parquet-text-column" in line


def test_show_samples_reads_parquet_as_training_streams_it(shards, tokenizer_model, capsys):
    from tools import show_samples

    argv = ["--data-path", shards, "--tokenizer-model", tokenizer_model, "--split", "100,0,0"]
    argv += ["--seq-length", str(SEQ), "--parquet-shuffle-buffer", str(WINDOW)]
    assert show_samples.main([*argv, "--num-samples", "2", "--max-chars", "100000"]) == 0
    printed = capsys.readouterr().out
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tokenizer_model))
    batches = _datasets(shards, tokenizer_model, split="100,0,0")[0].iterator(0, 1, 0, 1)
    for _ in range(2):
        batch = next(batches)
        ids = np.concatenate([batch["tokens"][0].numpy(), batch["labels"][0, -1:].numpy()])
        assert tokenizer.detokenize(ids) in printed
