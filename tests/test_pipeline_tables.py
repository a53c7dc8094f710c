"""Schedules as tables (parallel/pipeline/tables.py), their validator and the one runtime:
every generator's table is valid, its simulated bubble is the schedule's theoretical one and
its activations in flight the planner's count; the validator names broken tables; the
schedules that split backward (zb-h1, zb-v, dualpipe-v; tied and untied embeddings) give the
loss and every gradient of the PP=1 model, run exactly their tables, hold their 3D parity
with TP2 x DP2 and each sharding strategy, release sharded parameters behind each
input-gradient backward, and resume from a checkpoint bit-exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from parallel.errors import ConfigError
from parallel.pipeline.plan import Compute, Message, Plan, Post, Wait, forward_only, plan_transfers
from parallel.pipeline.schedules import peak_in_flight
from parallel.pipeline.tables import (
    GENERATORS,
    V_SHAPED,
    Action,
    Table,
    build_table,
    default_chunks,
    min_microbatches,
)
from parallel.pipeline.transport import check_plan
from parallel.pipeline.validate import ScheduleError, simulate, validate
from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    compare_params,
    engine_grads,
    engine_run,
    full_params,
    global_batch,
    model_error,
    opt_config,
    reference_grads,
    reference_run,
    tiny_config,
)
from tests.requirements import require

KINDS = {name: default_chunks(name) for name in GENERATORS}  # model chunks per rank


def _tables():
    for kind, v in KINDS.items():
        for p in (2, 3, 4):
            for m in (1, 2, 4, 8, 16):
                try:
                    yield build_table(kind, p, v, m)
                except ConfigError as err:  # interleaved: m % p; zb-v: m < 2p - 1; dualpipe-v
                    assert kind in ("interleaved", "zb-v", "dualpipe-v"), err  # m < 2p


def test_every_table_is_valid_with_the_theoretical_bubble_and_peak():
    bubbles = {}
    for table in _tables():
        timeline = validate(table)
        p, v, m = table.p, table.v, table.m
        for rank in range(p):  # the planner's count is what the table holds
            assert timeline.peak_in_flight[rank] == peak_in_flight(table.name, p, rank, m, v)
        bubble = max(timeline.bubble)
        bubbles[table.name, p, m] = bubble
        if table.name in ("gpipe", "1f1b"):  # F = 1, B = 2: (p - 1) / (m + p - 1)
            assert bubble == pytest.approx((p - 1) / (m + p - 1))
        if table.name == "interleaved":
            assert bubble == pytest.approx((p - 1) / (v * m + p - 1))
    for p in (2, 4):
        for m in (4, 8, 16):
            # zero bubble: smaller than 1F1B's at the same p and m, with 1F1B's peak memory
            assert bubbles["zb-h1", p, m] < bubbles["1f1b", p, m]
            if m >= 2 * p - 1:  # (equal at p = 2; below from p = 4)
                assert bubbles["zb-v", p, m] <= bubbles["zb-h1", p, m]
                assert p == 2 or bubbles["zb-v", p, m] < bubbles["zb-h1", p, m]
            if m >= 2 * p:  # simulated: below zb-v's too
                assert bubbles["dualpipe-v", p, m] < bubbles["zb-v", p, m]
    assert validate(build_table("zb-h1", 4, 1, 8), max_in_flight=4)


def test_dualpipe_v_runs_the_compute_order_of_torch_pipelining():
    """torch.distributed.pipelining's ScheduleDualPipeV is an independent reference: its
    per-rank compute actions (each overlapped forward-backward pair taken in turn, forward
    first) are ours, for p 2 to 4 and m from 2p to 4p."""
    schedules = require("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}

    class Sizes:  # what its per-rank generator reads from the schedule object
        def __init__(self, p, m):
            self.pp_group_size, self._n_microbatches = p, m

    for p in (2, 3, 4):
        for m in range(2 * p, 4 * p + 1):
            table = build_table("dualpipe-v", p, 2, m)
            for rank in range(p):
                theirs = []
                ops = schedules.ScheduleDualPipeV._calculate_single_rank_operations
                for action in ops(Sizes(p, m), rank):
                    for part in action.sub_actions or (action,):
                        kind = kinds[part.computation_type.value]
                        chunk = 0 if part.stage_index == rank else 1
                        theirs.append(str(Action(kind, chunk, part.microbatch_index)))
                assert [str(a) for a in table.ranks[rank]] == theirs, (p, m, rank)


def _broken(order0, order1, name="broken") -> Table:
    return Table(name, 2, 1, 2, "loop", (tuple(order0), tuple(order1)))


F, B = (lambda k: Action("F", 0, k)), (lambda k: Action("B", 0, k))


def test_the_validator_names_the_first_violation():
    good = build_table("1f1b", 2, 1, 2)
    cases = [
        (_broken([B(0), F(0), F(1), B(1)], good.ranks[1]), "step 0: B0.0 before its forward"),
        (_broken([F(0), F(1), B(0)], good.ranks[1]), "chunk 0 micro-batch 1 needs one backward"),
        (_broken([F(0), F(0), B(0), B(1)], good.ranks[1]), "F0.0 runs twice"),
        (_broken([F(0), F(1), Action("W", 0, 0), B(0), B(1)], good.ranks[1]),
         "W0.0 before its I"),
        # rank 0 waits for B0.0's gradient before sending F0.1's output, which rank 1 waits
        # for before its F0.0 and B0.0: a deadlock
        (_broken([F(0), B(0), F(1), B(1)], [F(1), F(0), B(0), B(1)]), "deadlock"),
    ]  # fmt: skip
    for table, match in cases:
        with pytest.raises(ScheduleError, match=match):
            validate(table)
    late = _broken([F(0), F(1), B(1), B(0)], [F(0), B(0), F(1), B(1)])
    with pytest.raises(ScheduleError, match="chunk 0's last gradient step is B0.0"):
        validate(late)
    # a rank may take its inputs in another order than they are sent: the plan receives them
    # in the shared order and holds the early one
    validate(
        Table(
            "reordered",
            2,
            1,
            3,
            "loop",
            ((F(0), F(1), F(2), B(0), B(1), B(2)), (F(0), F(2), F(1), B(0), B(1), B(2))),
        )
    )
    with pytest.raises(ScheduleError, match="holds 4 micro-batches of activations"):
        validate(build_table("gpipe", 2, 1, 4), max_in_flight=2)
    assert simulate(good).length == 9.0  # (m + p - 1) x (F + B)


def _runtime_before_plans(table: Table, overlap: bool) -> Plan:
    """The transfers the runtime posted before it had plans: a result sent in one batch with
    the receive the next action needs, a missing receive posted alone when needed, and with
    overlap the next two receives posted ahead, each alone."""
    steps = tuple(_steps_before_plans(table, rank, overlap) for rank in range(table.p))
    return Plan(table, overlap, steps)


def _steps_before_plans(table: Table, rank: int, overlap: bool) -> tuple:
    order, steps, batch_of = table.ranks[rank], [], {}

    def post(sends, receives):
        steps.append(Post(sum(isinstance(s, Post) for s in steps), tuple(sends), tuple(receives)))
        for message in receives:
            batch_of[message.consumer] = steps[-1].batch

    def incoming(action):
        source = table.partner(rank, action, incoming=True)
        if source is None or source[0] == rank:
            return None
        kind = "activation" if action.kind == "F" else "gradient"
        return Message(kind, source[0], source[1], rank, action, ())

    def ahead(index):
        for message in [m for m in map(incoming, order[index + 1 :]) if m][:2]:
            if message.consumer not in batch_of:
                post([], [message])

    if overlap:
        ahead(-1)
    for index, action in enumerate(order):
        need = incoming(action)
        if need is not None:
            if action not in batch_of:
                post([], [need])
            steps.append(Wait(batch_of[action]))
        steps.append(Compute(action))
        target = table.partner(rank, action, incoming=False)
        if target is not None and target[0] != rank:
            kind = "activation" if action.kind == "F" else "gradient"
            send = Message(kind, rank, action, target[0], target[1], ())
            upcoming = incoming(order[index + 1]) if index + 1 < len(order) else None
            fresh = upcoming is not None and upcoming.consumer not in batch_of
            post([send], [upcoming] if fresh else [])
        if overlap:
            ahead(index)
    return tuple(steps)


def _hangs(plan: Plan, transport: str) -> bool:
    try:
        check_plan(plan, transport)
    except ScheduleError as err:
        assert "hang" in str(err) or "would take" in str(err), err
        return True
    return False


def test_transfer_plans_run_under_nccl_rules_where_the_old_posting_hangs():
    """NCCL runs a rank's transfers in posting order on one stream, ends a batch only when all
    of it has met its peers and ignores tags: checked against the rules, the planned transfers
    of every table pass (training and forward-only, with and without overlap, under NCCL's and
    gloo's rules), while the runtime's earlier posting hangs where the issue found it would."""
    old_nccl, old_gloo = set(), set()
    for table in _tables():
        for run in (table, forward_only(table)):
            for overlap in (False, True):
                for transport in ("gloo", "nccl"):
                    check_plan(plan_transfers(run, overlap), transport)
                old = _runtime_before_plans(run, overlap)
                case = (table.name, table.p, table.m, run is table, overlap)
                if _hangs(old, "nccl"):
                    old_nccl.add(case)
                if _hangs(old, "gloo"):
                    old_gloo.add(case)
    assert not old_gloo  # gloo's tags and independent transfers forgave it
    for table in _tables():  # overlap: a receive posted alone ahead blocks the sends behind it
        assert (table.name, table.p, table.m, True, True) in old_nccl  # training: every table
        looped = table.name in ("interleaved", *V_SHAPED)  # evaluation: where data loops back
        assert ((table.name, table.p, table.m, False, True) in old_nccl) == looped
    without_overlap = {case[:3] for case in old_nccl if not case[4]}
    assert ("interleaved", 2, 4) in without_overlap  # micro-batches outnumber the stages
    assert ("interleaved", 2, 2) not in without_overlap
    assert ("dualpipe-v", 2, 4) in without_overlap
    assert ("1f1b", 4, 16) not in without_overlap and ("gpipe", 4, 16) not in without_overlap


def test_the_transport_rules_catch_hangs_and_mismatches():
    table = build_table("1f1b", 2, 1, 1)  # rank 0: F then B; rank 1: F then B
    act = Message("activation", 0, F(0), 1, F(0), ())
    grad = Message("gradient", 1, B(0), 0, B(0), ())
    fine = Plan(table, False, (
        (Compute(F(0)), Post(0, (act,), (grad,)), Wait(0), Compute(B(0))),
        (Post(0, (), (act,)), Wait(0), Compute(F(0)), Compute(B(0)), Post(1, (grad,), ())),
    ))  # fmt: skip
    for transport in ("gloo", "nccl"):
        check_plan(fine, transport)
    # rank 0 posts its receive of the gradient alone, ahead of its send: on NCCL's one stream
    # the send waits behind that receive, which waits for rank 1, which waits for the send
    ahead = Plan(table, False, (
        (Post(0, (), (grad,)), Compute(F(0)), Post(1, (act,), ()), Wait(0), Compute(B(0))),
        fine.ranks[1],
    ))  # fmt: skip
    check_plan(ahead, "gloo")
    with pytest.raises(ScheduleError, match="hang; waiting: rank 0 at wait for batch 0, rank 1"):
        check_plan(ahead, "nccl")
    two = build_table("gpipe", 2, 1, 2)
    acts = [Message("activation", 0, F(k), 1, F(k), ()) for k in range(2)]
    grads = [Message("gradient", 1, B(k), 0, B(k), ()) for k in range(2)]
    sender = (Compute(F(0)), Post(0, (acts[0],), ()), Compute(F(1)), Post(1, (acts[1],), ()),
              Post(2, (), tuple(grads)), Wait(2), Compute(B(0)), Compute(B(1)))  # fmt: skip
    swapped = (Post(0, (), (acts[1],)), Post(1, (), (acts[0],)), Wait(1), Compute(F(0)),
               Wait(0), Compute(F(1)), Compute(B(0)), Compute(B(1)),
               Post(2, tuple(grads), ()))  # fmt: skip
    with pytest.raises(ScheduleError, match="rank 1 would take activation of F0.0"):
        check_plan(Plan(two, False, (sender, swapped)), "gloo")
    unwaited = (Post(0, (), (acts[0],)), Compute(F(0)))
    with pytest.raises(ScheduleError, match="rank 1 runs F0.0 before waiting for its input"):
        check_plan(Plan(two, False, (sender, unwaited)), "gloo")
    early = (Post(0, (acts[0],), ()),) + sender[:1] + sender[2:]
    with pytest.raises(ScheduleError, match="rank 0 posts the result of F0.0 before computing"):
        check_plan(Plan(two, False, (early, swapped)), "gloo")
    with pytest.raises(ScheduleError, match="rank 1 waits for batch 3 before posting it"):
        check_plan(Plan(two, False, (sender, (Wait(3),) + swapped)), "nccl")


def _zero_bubble(rank, world, pp):
    state = ParallelState.build(tp=1, pp=pp)
    out = []
    for style in ("gpt2", "llama"):
        cfg = tiny_config(style, num_layers=8)
        for m in (1, 4, 8):
            tokens = global_batch(m, 2 * m * state.dp_size, cfg.seq_length)
            ref_loss, ref_grads = reference_grads(cfg, tokens)
            for kind, overlap in itertools.product(("zb-h1", "zb-v", "dualpipe-v"), (False, True)):
                if m < min_microbatches(kind, pp):
                    continue  # zb-v needs m >= 2p - 1, dualpipe-v m >= 2p
                stats = {}
                losses, grads = engine_grads(
                    state, cfg, tokens, 2, schedule_kind=kind, stats=stats,
                    virtual_size=KINDS[kind], overlap_p2p=overlap, trace=True,
                )  # fmt: skip
                loss = None
                if losses:
                    mean = torch.stack(losses).mean().reshape(1)
                    if state.dp_group is not None:
                        torch.distributed.all_reduce(mean, group=state.dp_group)
                        mean /= state.dp_size
                    loss = abs(mean.item() - ref_loss) / ref_loss
                table = build_table(kind, pp, KINDS[kind], m)
                ran = [name for name, _, _ in stats["events"]]
                out.append({
                    "case": (style, m, kind, overlap), "rank": state.pp_rank, "loss": loss,
                    "grad": max(compare_params(grads, ref_grads).values()),
                    "ran_its_table": ran == [str(a) for a in table.ranks[state.pp_rank]],
                    "peak": stats["peak_held"], "overlapped": stats["computes_overlapped"],
                })  # fmt: skip
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_zero_bubble_schedules_match_unpipelined_model(pp):
    results = run_ranks(_zero_bubble, 4, pp, timeout=400)
    for rank_results in results:
        # zb-h1: 12; zb-v (m >= 2p - 1): 8, then 4; dualpipe-v (m >= 2p): 8, then 4
        assert len(rank_results) == (28 if pp == 2 else 20)
        for r in rank_results:
            style, m, kind, overlap = r["case"]
            assert r["grad"] < 1e-5 and r["ran_its_table"], r
            assert r["peak"] == peak_in_flight(kind, pp, r["rank"], m, KINDS[kind]), r
            if overlap and m >= pp:
                assert r["overlapped"] > 0, r
            elif not overlap:
                assert r["overlapped"] == 0, r
            if kind == "zb-h1" and r["rank"] == pp - 1 or kind in V_SHAPED and r["rank"] == 0:
                assert r["loss"] is not None and r["loss"] < 1e-6, r


THREE_D_ZERO_BUBBLE = [
    ("gpt2", "no_shard", "zb-h1"),
    ("gpt2", "optim", "zb-h1"),
    ("llama", "optim_grads", "zb-h1"),
    ("gpt2", "optim_grads_params", "zb-h1"),
    ("llama", "optim_grads_params", "zb-h1"),
    ("gpt2", "optim", "zb-v"),
    ("llama", "optim_grads", "zb-v"),
    ("gpt2", "optim_grads_params", "zb-v"),
    ("gpt2", "optim", "dualpipe-v"),
    ("llama", "optim_grads_params", "dualpipe-v"),
]


def _three_d(rank, world):
    state = ParallelState.build(tp=2, pp=2)
    out, references = [], {}  # one reference run per style
    for style, sharding, kind in THREE_D_ZERO_BUBBLE:
        cfg, ocfg = tiny_config(style, num_layers=4), opt_config()
        if style not in references:
            references[style] = reference_run(cfg, ocfg, 5, 16)
        ref_losses, _, ref_params, initial = references[style]
        outputs, ddps, _ = engine_run(
            state, cfg, ocfg, 5, 16, 2, sharding=sharding, overlap=True, sequence_parallel=True,
            virtual_size=KINDS[kind], schedule_kind=kind,
        )  # fmt: skip
        losses = [o.loss for o in outputs]
        loss = None
        if losses[0] is not None:
            loss = max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True))
        error = model_error(full_params(ddps, state), ref_params, initial)
        out.append({"case": (style, sharding, kind), **error, "loss": loss})
    return out


def test_zero_bubble_in_3d_with_each_sharding_strategy():
    """TP2 x PP2 x DP2 with SP and overlapped reductions, 5 optimizer steps of 4 micro-batches:
    the weight gradients deferred to W reach the (sharded) gradient buffers as a plain
    backward's do, also where the next micro-batch's I writes a bucket before the previous
    one's W (a bucket with no deferred weight, e.g. the final norm's under
    optim_grads_params, is reduced during I)."""
    results = run_ranks(_three_d, 8, timeout=400)
    for rank_results in results:
        for r in rank_results:
            assert r["moved"] > 0.02, r
            assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
    # the loss is computed on the last virtual stage: pipeline rank 1 for zb-h1, 0 for the V
    for rank, kind in ((7, "zb-h1"), (0, "zb-v"), (0, "dualpipe-v")):
        for r in results[rank]:
            if r["case"][2] == kind:
                assert r["loss"] is not None and r["loss"] < 1e-6, r


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--pipeline-schedule", "zb-v", "--untie-embeddings-and-output-weights"],
         "zb-v runs 2 model chunks per rank"),
        (["--pipeline-schedule", "zb-h1", "--use-megatron-fsdp"], None),
        (["--pipeline-schedule", "zb-h1", "--no-gradient-accumulation-fusion"],
         "drop that flag or use 1f1b"),
        (["--pipeline-schedule", "zb-v", "--untie-embeddings-and-output-weights",
          "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "2"],
         "at least 2 x pipeline-model-parallel-size - 1 = 3 micro-batches"),
        (["--pipeline-schedule", "zb-v", "--untie-embeddings-and-output-weights",
          "--num-layers-per-virtual-pipeline-stage", "1"], None),
        (["--pipeline-schedule", "zb-v", "--num-layers-per-virtual-pipeline-stage", "1"], None),
        (["--pipeline-schedule", "dualpipe-v"], "dualpipe-v runs 2 model chunks per rank"),
        (["--pipeline-schedule", "dualpipe-v", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "3"],
         "at least 2 x pipeline-model-parallel-size = 4 micro-batches"),
        (["--pipeline-schedule", "dualpipe-v", "--num-layers-per-virtual-pipeline-stage", "1",
          "--no-gradient-accumulation-fusion"], "drop that flag or use 1f1b"),
        (["--pipeline-schedule", "dualpipe-v", "--num-layers-per-virtual-pipeline-stage", "1",
          "--use-megatron-fsdp"], None),
        (["--pipeline-schedule", "zb-h1"], None),
    ],
)  # fmt: skip
def test_the_engine_checks_zero_bubble_flags(extra, match):
    from engine.config.checks import check_layout_flags
    from engine.config.resolve import resolve
    from engine.pretrain import parse

    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "100",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1",
             "--pipeline-model-parallel-size", "2", *extra]  # fmt: skip
    if match is None:
        assert check_layout_flags(resolve(parse(flags), 2), 2) == 1
    else:
        with pytest.raises(ConfigError, match=match):
            check_layout_flags(resolve(parse(flags), 2), 2)


def _pretrain(rank, world, flags):
    from engine.pretrain import main

    return main(flags)


@pytest.mark.parametrize(
    "schedule, tied, world",
    [
        ("zb-h1", False, 2),
        ("zb-v", False, 2),
        ("zb-v", True, 2),
        ("zb-h1", True, 4),
        ("dualpipe-v", True, 2),
    ],
)
def test_zero_bubble_training_resumes_bit_exactly(tmp_path, schedule, tied, world):
    """engine.pretrain on PP 2 (x DP 2 with sharded parameters): 4 iterations straight,
    against 2, a checkpoint, and 2 more from it; the losses are equal to the last bit. Tied
    zb-v: the first rank holds both copies of the embedding, and the checkpoint's one tensor
    fills both."""
    import json

    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
             "--tokenizer-type", "NullTokenizer", "--mock-data", "--lr", "1e-3",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
             "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
             "--log-interval", "1",
             "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
             "--eval-iters", "0"]  # fmt: skip
    if schedule in V_SHAPED:
        flags += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if not tied:
        flags += ["--untie-embeddings-and-output-weights"]
    if world == 4:
        flags += ["--use-megatron-fsdp", "--global-batch-size", "8"]
    checkpoints = str(tmp_path / "checkpoints")
    runs = {
        "straight": [],
        "first": ["--save", checkpoints, "--save-interval", "2", "--exit-interval", "2"],
        "resumed": ["--load", checkpoints, "--save", checkpoints],
    }
    losses = {}
    for name, extra in runs.items():
        log = tmp_path / f"{name}.jsonl"
        run_ranks(_pretrain, world, flags + extra + ["--log-jsonl", str(log)], timeout=300)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        losses[name] = [(r["iteration"], r["lm_loss"]) for r in records if "lm_loss" in r]
    assert [i for i, _ in losses["straight"]] == [1, 2, 3, 4]
    assert losses["first"] + losses["resumed"] == losses["straight"]


def _gathered_under_zero_bubble(rank, world, kind):
    """The most units whose parameters are gathered at once on this rank, seen from every
    module's forward and every gradient hook, over two steps of 8 micro-batches with the
    parameters sharded (optim_grads_params)."""
    from parallel.data_parallel.buckets import is_allocated

    state = ParallelState.build(tp=1, pp=2)
    cfg = tiny_config("gpt2", num_layers=8)
    peak = {"units": 0}

    def look(ddps):
        gathered = sum(is_allocated(b.data) for ddp in ddps for b in ddp.buckets)
        peak["units"] = max(peak["units"], gathered)

    def hook(step, ddps, optimizer):
        if step == 0:
            for ddp in ddps:
                for module in ddp.module.modules():
                    module.register_forward_pre_hook(lambda *_: look(ddps))
                for param in ddp.params:
                    param.register_hook(lambda grad: look(ddps))

    _, ddps, _ = engine_run(
        state, cfg, opt_config(), 2, 32, 2, sharding="optim_grads_params", overlap=True,
        hook=hook, virtual_size=KINDS[kind], schedule_kind=kind,
    )  # fmt: skip
    return peak["units"], sum(len(ddp.buckets) for ddp in ddps)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-v", "dualpipe-v"])
def test_sharded_parameters_are_released_behind_each_input_gradient_backward(kind):
    """With the weight gradients deferred, a unit's parameters are still released as soon as
    the input-gradient backward has passed it (its W needs none of them): as many units at
    once as under 1F1B, not the whole chunk."""
    for units, buckets in run_ranks(_gathered_under_zero_bubble, 4, kind):
        assert buckets >= 4, buckets  # 8 layers over 2 (zb-v: 4) stages, embeddings, norm
        assert 2 <= units <= 3, (units, buckets)
