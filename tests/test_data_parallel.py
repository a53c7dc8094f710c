"""Data parallelism and the distributed optimizer against a single-process run on the same
global batch: parameters after 5 steps, DP 2 and 4, every sharding strategy (no_shard, optim,
optim_grads, optim_grads_params), overlap on and off, TP2 x DP2; the bytes each strategy
holds per rank, and what it holds while it computes; optimizer-state memory per rank; fp16
loss scaling; bf16 tracking fp32; gradients reduced in bf16; the order and the waits of
--overlap-param-gather's gathers."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.data_parallel.buckets import is_allocated
from parallel.data_parallel.ddp import STRATEGIES
from parallel.state import ParallelState
from tests.distributed import rel_err, run_ranks
from tests.harness import (
    engine_run,
    engine_steps,
    full_params,
    model_error,
    opt_config,
    reference_run,
    tiny_config,
)

STEPS, GBS, MBS = 5, 8, 2


def _dp_parity(rank, world, tp, every_case=True):
    """Each style under each sharding strategy, overlapped and not; without `every_case`, each
    (style, strategy) once, overlapped or not in turn, so that every strategy still runs both
    ways and each style both ways."""
    state = ParallelState.build(tp=tp)
    results = []
    for s, style in enumerate(("gpt2", "llama")):
        cfg, ocfg = tiny_config(style), opt_config()
        ref_losses, ref_norms, ref_params, initial = reference_run(cfg, ocfg, STEPS, GBS)
        for k, sharding in enumerate(STRATEGIES):
            for overlap in (False, True) if every_case else (bool((s + k) % 2),):
                outputs, ddps, optimizer = engine_run(
                    state,
                    cfg,
                    ocfg,
                    STEPS,
                    GBS,
                    MBS,
                    sharding=sharding,
                    overlap=overlap,
                    overlap_param_gather=overlap,
                )
                errors = model_error(full_params(ddps, state), ref_params, initial)
                results.append(
                    {
                        "case": (style, sharding, overlap),
                        "buckets": len(ddps[0].buckets),
                        **errors,
                        "loss_err": max(
                            abs(o.loss - r) / r for o, r in zip(outputs, ref_losses, strict=True)
                        ),
                        "norm_err": max(
                            abs(o.grad_norm - r) / r
                            for o, r in zip(outputs, ref_norms, strict=True)
                        ),
                    }
                )
    return results


def _check(results):
    for rank_results in results:
        for r in rank_results:
            assert r["buckets"] > 1, r  # several buckets, so bucketing is exercised
            assert r["moved"] > 0.02, r  # five steps changed the parameters by more than 2%
            assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
            assert r["loss_err"] < 1e-6 and r["norm_err"] < 1e-6, r


def test_dp2_matches_single_process():
    _check(run_ranks(_dp_parity, 2, 1))


def test_dp4_and_tp2_dp2_match_single_process():
    """Half of DP 2's cases each (the overlap alternating), on four ranks."""
    _check(run_ranks(_dp_parity, 4, 1, False))
    _check(run_ranks(_dp_parity, 4, 2, False))


def _memory(rank, world):
    state = ParallelState.build(tp=1)
    cfg = tiny_config("gpt2", hidden_size=64, num_layers=2)
    out = {}
    for zero in (False, True):
        _, ddps, optimizer = engine_run(
            state, cfg, opt_config(), 1, 8, 2, zero=zero, dtype=torch.bfloat16, bucket_size=5000
        )
        ddp = ddps[0]
        params = sum(p.numel() for p in ddp.params)
        out[zero] = {
            "params": params,
            "padding": ddp.padding(),
            "state_bytes": optimizer.state_bytes(),
            "buffer_bytes": sum(
                t.numel() * t.element_size()
                for t in (ddp.buffers[0].param_buffer, ddp.buffers[0].grad_buffer)
            ),
        }
    return out


def test_optimizer_state_is_sharded_over_dp():
    results = run_ranks(_memory, 4)
    params = results[0][True]["params"]
    padding = results[0][True]["padding"]
    for r in results:
        assert r[False]["state_bytes"] == 12 * params  # fp32 master + two moments, replicated
        sharded = r[True]["state_bytes"]
        assert abs(sharded - 12 * params / 4) <= 12 * padding, (sharded, params, padding)
        per_param = (r[True]["buffer_bytes"] + sharded) / params
        assert abs(per_param - (6 + 12 / 4)) < 0.1 * (1 + padding), per_param  # 6 + 12/DP
    assert sum(r[True]["state_bytes"] for r in results) == 12 * params  # a partition


def _held_by_strategy(rank, world):
    from engine.planning.state_memory import held_state_bytes

    state = ParallelState.build(tp=1)
    cfg = tiny_config("llama", hidden_size=128, num_layers=4)
    out = {}
    for sharding in STRATEGIES:
        _, ddps, optimizer = engine_run(
            state, cfg, opt_config(), 1, 8, 2, sharding=sharding, dtype=torch.bfloat16
        )
        params = sum(p.numel() for d in ddps for p in d.params)
        out[sharding] = (params, held_state_bytes(ddps, optimizer))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_each_sharding_strategy_holds_its_formulas_bytes(world):
    """Storage bytes of parameters, gradients and optimizer state held after a step (bf16,
    Adam) per rank, within 5% of 18, 6 + 12/d, 2 + 16/d and 18/d bytes per parameter."""
    from engine.planning.state_memory import formula_bytes_per_param

    for per_rank in run_ranks(_held_by_strategy, world):
        for sharding, (params, held) in per_rank.items():
            formula = formula_bytes_per_param(sharding, world)
            for kind, bytes_per_param in formula.items():
                expected = bytes_per_param * params
                assert abs(held[kind] - expected) <= 0.05 * expected, (sharding, kind, held)


def _held_while_computing(rank, world, sharding, overlap):
    """The most bucket parameters and full bucket gradients allocated at once, seen from
    every module's forward and from every gradient hook, over two steps of 2 micro-batches."""
    state = ParallelState.build(tp=1)
    cfg = tiny_config("gpt2", num_layers=6)
    peaks = {"params": 0, "grads": 0}

    def look(ddp):
        if ddp.shard_params:
            gathered = sum(is_allocated(b.data) for b in ddp.buckets)
            peaks["params"] = max(peaks["params"], gathered)
        live = sum(is_allocated(b.grad) for b in ddp.buckets if not b.delayed)
        peaks["grads"] = max(peaks["grads"], live)

    def hook(step, ddps, optimizer):
        if step == 0:
            ddp = ddps[0]
            for module in ddp.module.modules():
                module.register_forward_pre_hook(lambda *_: look(ddp))
            for param in ddp.params:
                param.register_hook(lambda grad: look(ddp))

    _, ddps, _ = engine_run(
        state, cfg, opt_config(), 2, 8, 2, sharding=sharding, overlap=overlap, hook=hook
    )
    return peaks, len(ddps[0].buckets)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sharding", ["optim_grads", "optim_grads_params"])
def test_sharded_strategies_hold_only_the_buckets_in_use(sharding, overlap):
    """optim_grads: a bucket's full gradient only while its backward fills it (with the
    reduction overlapped, also while it is reduced during the next bucket's backward);
    optim_grads_params: a unit's parameters only around its forward and backward: at most
    itself, the one prefetched, and one more: in backward the tied embedding table, kept
    from the output layer's backward until the input embedding's (its gradient is complete
    only then), in forward the embedding unit around the word embeddings."""
    for peaks, buckets in run_ranks(_held_while_computing, 2, sharding, overlap):
        assert buckets >= 9, buckets  # one per layer, two for the embeddings, final norm
        assert 1 <= peaks["grads"] <= 2, peaks
        if sharding == "optim_grads_params":
            assert 2 <= peaks["params"] <= 3, peaks


def _fp16_inf(rank, world, sharding):
    state = ParallelState.build(tp=1)
    cfg = tiny_config("gpt2")
    ocfg = opt_config(initial_loss_scale=2.0**10, hysteresis=1, loss_scale_window=1000)
    snapshots = []

    def snapshot(ddp):
        with ddp.gathered_parameters():
            snapshots.append(torch.cat([p.detach().float().reshape(-1) for p in ddp.params]))

    def hook(step, ddps, optimizer):
        snapshot(ddps[0])
        if step == 2 and rank == 1:  # poison one rank's gradient: every rank must skip
            ddps[0].params[0].register_hook(lambda g: torch.full_like(g, float("inf")))

    outputs, ddps, _ = engine_run(
        state, cfg, ocfg, 5, 8, 2, sharding=sharding, dtype=torch.float16, fp16=True, hook=hook
    )
    snapshot(ddps[0])
    changed = [not torch.equal(a, b) for a, b in zip(snapshots, snapshots[1:], strict=False)]
    return [o.updated for o in outputs], [o.loss_scale for o in outputs], changed


@pytest.mark.parametrize("sharding", ["optim", "optim_grads", "optim_grads_params"])
def test_fp16_inf_skips_exactly_that_step_and_backs_off(sharding):
    for updated, scales, changed in run_ranks(_fp16_inf, 2, sharding):
        # the hook installed before step 2 fires in step 2 and every later step
        assert updated == [True, True, False, False, False]
        assert changed == [True, True, False, False, False]
        assert scales == [1024.0, 1024.0, 1024.0, 512.0, 256.0]


def _bf16_tracks_fp32(rank, world):
    state = ParallelState.build(tp=2)
    cfg, ocfg = tiny_config("llama"), opt_config(lr=3e-3)
    fp32, _, _ = engine_run(state, cfg, ocfg, 20, 8, 2, zero=True, repeat_batch=True)
    bf16 = {}
    for sharding in ("optim", "optim_grads_params"):
        outputs, _, _ = engine_run(
            state,
            cfg,
            ocfg,
            20,
            8,
            2,
            sharding=sharding,
            dtype=torch.bfloat16,
            repeat_batch=True,
        )
        bf16[sharding] = [o.loss for o in outputs]
    return [o.loss for o in fp32], bf16


def test_bf16_tracks_fp32_loss():
    """bf16 parameters with fp32 masters, under the distributed optimizer and with sharded
    parameters, follow the fp32 loss curve."""
    fp32, bf16 = run_ranks(_bf16_tracks_fp32, 4)[0]
    assert fp32[-1] < fp32[0] - 1.0  # it learns (memorises the batch)
    for losses in bf16.values():
        for a, b in zip(fp32, losses, strict=True):
            assert abs(a - b) / a < 0.02, (a, b)


def _below_one_ulp(rank, world, sharding):
    state = ParallelState.build(tp=1)
    cfg = tiny_config("llama")
    # Adam's first step moves each weight by about lr: 1e-6 is far below half a bf16 ulp of
    # weights of ~0.02 (about 6e-5), so the bf16 weights round back to where they were
    ocfg = opt_config(lr=1e-6, weight_decay=0.0, clip_grad=0.0)
    seen = {}

    def hook(step, ddps, optimizer):
        seen[step] = (
            torch.cat([p.master.detach().reshape(-1).clone() for p in optimizer.pieces]),
            torch.cat([p.data.detach().float().reshape(-1).clone() for p in optimizer.pieces]),
        )

    engine_run(state, cfg, ocfg, 2, 8, 2, sharding=sharding, dtype=torch.bfloat16, hook=hook)
    (master0, data0), (master1, data1) = seen[0], seen[1]
    return (master1 != master0).float().mean().item(), (data1 != data0).float().mean().item()


@pytest.mark.parametrize("sharding", ["no_shard", "optim"])
def test_an_update_below_one_bf16_ulp_moves_the_fp32_master(sharding):
    """bf16 parameters keep fp32 masters: an update far below one bf16 ulp leaves (almost)
    every bf16 weight as it was, and moves (almost) every fp32 master; updating the bf16
    weights directly would lose it."""
    for master_moved, weights_moved in run_ranks(_below_one_ulp, 2, sharding):
        assert master_moved > 0.5, (master_moved, weights_moved)  # (padding rows get none)
        assert weights_moved < 0.1, (master_moved, weights_moved)


def _overlapped_gpt2():
    """(state, config, DDP of a tiny GPT-2 with --overlap-grad-reduce into small buckets)."""
    from engine.model.builder import build_model_chunks
    from parallel.data_parallel.ddp import DistributedDataParallel

    state = ParallelState.build(tp=1)
    cfg = tiny_config("gpt2")
    chunk = build_model_chunks(cfg, state)[0]
    ddp = DistributedDataParallel(chunk, state.dp_group, bucket_size=2000, overlap_grad_reduce=True)
    return state, cfg, ddp


def _launched_before_the_last_layer(rank, world):
    """How many buckets had launched their reduction when backward reached the embedding's
    output (the first layer's GEMMs, the last of backward, done), and how many there are."""
    from engine.train.loss import make_loss_func
    from engine.train.step import forward_step
    from tests.harness import global_batch, micro_batches

    state, cfg, ddp = _overlapped_gpt2()
    seen = []

    def record(grad):
        seen.append(sum(b.grad_work is not None for b in ddp.buckets))

    def watch(module, inputs, out):
        out.register_hook(record)

    ddp.module.embedding.register_forward_hook(watch)
    (batch,) = micro_batches(global_batch(0, 4, cfg.seq_length), 2, state.dp_rank, 2)
    loss_func = make_loss_func(1)
    loss_func(forward_step(ddp, batch, None), batch)[0].backward()
    ddp.finish_grad_sync()
    return seen, len(ddp.buckets)


def test_the_first_reduction_starts_before_backward_ends():
    """With --overlap-grad-reduce the buckets of the last layers are reduced while backward
    still runs the first layers: when the gradient reaches the embedding's output, buckets
    have launched already (a reduction started only at the end would show none)."""
    for seen, buckets in run_ranks(_launched_before_the_last_layer, 2):
        assert buckets > 2 and len(seen) == 1, (seen, buckets)
        assert 1 <= seen[0] < buckets, (seen, buckets)


def _overlap_launch_points(rank, world):
    from engine.train.loss import make_loss_func
    from engine.train.step import forward_step
    from tests.harness import global_batch, micro_batches

    state, cfg, ddp = _overlapped_gpt2()
    batches = micro_batches(global_batch(0, 8, cfg.seq_length), 2, state.dp_rank, 2)
    loss_func = make_loss_func(len(batches))
    launched = []
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        if not last:
            with ddp.no_sync():
                loss_func(forward_step(ddp, batch, None), batch)[0].backward()
        else:
            loss_func(forward_step(ddp, batch, None), batch)[0].backward()
        launched.append(sum(b.grad_work is not None for b in ddp.buckets))
    ddp.finish_grad_sync()
    return launched, len(ddp.buckets)


def test_overlap_launches_each_bucket_in_the_last_backward_only():
    for launched, buckets in run_ranks(_overlap_launch_points, 2):
        assert buckets > 1
        assert launched == [0, buckets], launched  # nothing during the no_sync micro-batch


def test_grad_reduce_in_bf16_keeps_and_reduces_main_grads_in_bf16():
    """--bf16 --grad-reduce-in-bf16 on two DP ranks (plain and with the distributed optimizer,
    whose reduce-scatter then runs in bf16): the main grads are bf16, training follows the
    fp32-reduced run closely but not bit for bit; without --bf16 the flag changes nothing."""
    for sharded in ([], ["--use-distributed-optimizer"]):
        base = ["--bf16", *sharded]
        fp32 = run_ranks(engine_steps, 2, base)
        bf16 = run_ranks(engine_steps, 2, base + ["--grad-reduce-in-bf16"])
        assert fp32[0][3] == torch.float32 and bf16[0][3] == torch.bfloat16
        (_, after32, losses32, _), (_, after16, losses16, _) = fp32[0], bf16[0]
        assert losses16 == pytest.approx(losses32, rel=2e-2)
        assert any(not torch.equal(after32[n], after16[n]) for n in after32)
        for name in after32:
            # (biases left out: the attention key bias has an exactly-zero true gradient, which
            # Adam turns into lr-sized steps of rounding noise either way)
            if after32[name].ndim == 2:
                assert rel_err(after16[name], after32[name]) < 2e-2, name
        # the DP ranks agree on the weights
        assert all(torch.equal(bf16[0][1][n], bf16[1][1][n]) for n in after16)
    plain = run_ranks(engine_steps, 2, [])
    flagged = run_ranks(engine_steps, 2, ["--grad-reduce-in-bf16"])
    assert flagged[0][3] == torch.float32
    assert all(torch.equal(plain[0][1][n], flagged[0][1][n]) for n in plain[0][1])


class _ParamReads(TorchDispatchMode):
    """Checks every op that reads a parameter buffer: the bucket it reads must not have an
    all-gather in flight. Also records the buckets of the parameter all-gathers, in order."""

    def __init__(self, ddps):
        super().__init__()
        self.ddps, self.unwaited, self.reads, self.gathers = ddps, [], 0, []

    def _bucket(self, tensor):
        for chunk, ddp in enumerate(self.ddps):
            buffer = ddp.buffers[0].param_buffer.untyped_storage()
            if tensor.untyped_storage().data_ptr() == buffer.data_ptr():
                offset = tensor.storage_offset()
                return chunk, next(b for b in ddp.buckets if b.start <= offset < b.end)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        found = [(t, self._bucket(t)) for t in tensors]
        found = [(t, hit) for t, hit in found if hit is not None]
        if "allgather" in str(func):
            # one entry per gather (its input, gathered in place, is a slice of its output)
            self.gathers += list(dict.fromkeys((hit[0], hit[1].index) for _, hit in found))
        elif "c10d" not in str(func) and not func.is_view:  # a view reads nothing
            for _, (chunk, bucket) in found:
                self.reads += 1
                if bucket.param_work is not None:
                    self.unwaited.append((str(func), chunk, bucket.index))
        return func(*args, **(kwargs or {}))


def _param_gather_order(rank, world):
    state = ParallelState.build(tp=1, pp=2)
    cfg, ocfg = tiny_config("gpt2"), opt_config()  # tied embeddings: the last stage has a copy
    ref_losses, _, ref_params, initial = reference_run(cfg, ocfg, STEPS, GBS)
    modes = []

    def watch(step, ddps, optimizer):
        if step == 1:  # from here on the previous step's gathers are in flight
            modes.append(_ParamReads(ddps))
            modes[0].__enter__()

    outputs, ddps, _ = engine_run(
        state, cfg, ocfg, STEPS, GBS, MBS, zero=True, overlap_param_gather=True, hook=watch
    )
    modes[0].__exit__(None, None, None)
    mode = modes[0]
    return {
        "stage": state.pp_rank,
        "unwaited": mode.unwaited,
        "reads": mode.reads,
        "gathers": mode.gathers,
        "buckets": len(ddps[0].buckets),
        **model_error(full_params(ddps, state), ref_params, initial),
    }


def test_param_gathers_go_in_forward_order_and_every_read_waits_for_its_gather():
    """PP2 x DP2 with tied embeddings, --overlap-param-gather: the gathers of a step are issued
    from the first layers' bucket to the last, and no operation (the last stage's tied output
    layer included) reads a parameter whose gather is still in flight; the result equals one
    process's."""
    for r in run_ranks(_param_gather_order, 4):
        assert r["buckets"] > 2, r["buckets"]
        assert r["reads"] > 0 and r["unwaited"] == [], r["unwaited"][:5]
        per_step = [index for _, index in r["gathers"]]
        steps = STEPS - 1  # gathers issued by steps 1.. after the watch began
        expected = list(reversed(range(r["buckets"]))) * steps
        assert per_step == expected, (per_step, expected)
        assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r


@pytest.mark.parametrize("sharding", ["no_shard", "optim"])
def test_a_buffer_without_a_group_scales_its_gradient_once_under_overlap(sharding):
    """An experts' buffer whose expert data-parallel group is this rank alone still scales by
    1/(DP x CP); with --overlap-grad-reduce its bucket must not be scaled again at the end."""
    from parallel.data_parallel.param_and_grad_buffer import ParamAndGradBuffer

    layer = torch.nn.Linear(4, 4, bias=False)
    params = list(layer.parameters())
    buffer = ParamAndGradBuffer(
        layer,
        params,
        None,
        sharding=sharding,
        bucket_size=1000,
        grad_dtype=torch.float32,
        grad_scale=0.5,
        overlap_grad_reduce=True,
        overlap_param_gather=False,
        units=None,
    )
    params[0].main_grad.fill_(1.0)
    buffer.main_grad_added(params[0], is_last_microbatch=True)
    buffer.finish_grad_sync()
    (bucket,) = buffer.buckets
    start, end = buffer.param_range[params[0]]
    assert torch.equal(buffer.grad_of(bucket, start, end), torch.full((16,), 0.5))
