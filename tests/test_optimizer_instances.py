"""--num-distributed-optimizer-instances (Megatron-LM's meaning): the process groups held to
megatron-core's own (its initialize_model_parallel, run on the same gloo ranks); DP 4 with 2
and 4 instances against a single-process run under every sharding strategy, overlap on and
off (parameters, losses and the gradient norm: each element counted once), each instance
holding all of the optimizer state once; through the launcher: the losses of a run without
instances, a checkpoint saved with 2 instances resumed with none, replicas compared across
instances; bad values refused in one line."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from engine.errors import ConfigError
from engine.pretrain import parse
from engine.train.preflight import prepare
from parallel.state import ParallelState, layout_groups
from tests.distributed import run_ranks
from tests.harness import (
    engine_run,
    full_params,
    model_error,
    opt_config,
    reference_run,
    tiny_config,
)
from tests.requirements import require
from tests.test_training import base_args, latest, losses, pretrain

# (tp, cp, dp, pp, instances) on 8 ranks
LAYOUTS = [(2, 1, 4, 1, 2), (1, 2, 2, 2, 2), (1, 1, 8, 1, 4), (2, 1, 4, 1, 4)]
KINDS = ("dp_cp_shard", "dp_cp_replica", "instance")


def _megatron_groups(rank, world, layouts):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as mcore

    found = []
    for tp, cp, _dp, pp, instances in layouts:
        mcore.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            num_distributed_optimizer_instances=instances,
            create_gloo_process_groups=False,
        )
        theirs = {
            "dp_cp_shard": mcore.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True
            ),
            "dp_cp_replica": mcore.get_inter_distributed_optimizer_instance_group(),
            "instance": mcore.get_intra_distributed_optimizer_instance_group(),
        }
        theirs = {k: dist.get_process_group_ranks(g) for k, g in theirs.items()}
        mcore.destroy_model_parallel()
        state = ParallelState.build(tp=tp, pp=pp, cp=cp, optimizer_instances=instances)
        ours = {
            "dp_cp_shard": state.dp_cp_shard_group,
            "dp_cp_replica": state.dp_cp_replica_group,
            "instance": state.optimizer_instance_group,
        }
        ours = {k: dist.get_process_group_ranks(g) if g else [rank] for k, g in ours.items()}
        found.append((theirs, ours))
    return found


def test_groups_equal_megatron_cores():
    require("einops")  # megatron-core needs it for these groups
    require("megatron.core")
    results = run_ranks(_megatron_groups, 8, LAYOUTS)
    for rank, found in enumerate(results):
        for layout, (theirs, ours) in zip(LAYOUTS, found, strict=True):
            assert ours == theirs, (rank, layout)
    for layout in LAYOUTS:  # every rank in exactly one group of each kind
        groups = layout_groups(*layout[:4], instances=layout[4])
        for kind in KINDS:
            members = sorted(r for g in groups[kind] for r in g)
            assert members == list(range(8)), (layout, kind)


STEPS, GBS, MBS = 4, 8, 2


def _instances_parity(rank, world, instances):
    state = ParallelState.build(tp=1, optimizer_instances=instances)
    cfg, ocfg = tiny_config("gpt2"), opt_config()
    ref_losses, ref_norms, ref_params, initial = reference_run(cfg, ocfg, STEPS, GBS)
    results = []
    for sharding in ("optim", "optim_grads", "optim_grads_params"):
        for overlap in (False, True):
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
            held = sum(p.numel for p in optimizer.pieces)
            results.append(
                {
                    "case": (instances, sharding, overlap),
                    **errors,
                    "loss_err": max(
                        abs(o.loss - r) / r for o, r in zip(outputs, ref_losses, strict=True)
                    ),
                    "norm_err": max(
                        abs(o.grad_norm - r) / r for o, r in zip(outputs, ref_norms, strict=True)
                    ),
                    "held": held,
                    "params": sum(p.numel() for d in ddps for p in d.params),
                    "padding": sum(d.padding() for d in ddps),
                    "shard_size": ddps[0].buffers[0].dp_size,
                }
            )
    return results


@pytest.mark.parametrize("instances", [2, 4])
def test_dp4_with_instances_matches_single_process(instances):
    results = run_ranks(_instances_parity, 4, instances)
    for rank_results in results:
        for r in rank_results:
            assert r["shard_size"] == 4 // instances, r
            assert r["moved"] > 0.02, r
            assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
            assert r["loss_err"] < 1e-6 and r["norm_err"] < 1e-6, r
            # a rank holds 1/(DP / instances) of the parameters' optimizer state
            share = r["params"] * instances / 4
            assert abs(r["held"] - share) <= r["padding"], r
    for case in range(len(results[0])):  # every instance holds all of it once
        held = sum(rank_results[case]["held"] for rank_results in results)
        assert held == results[0][case]["params"] * instances, results[0][case]


def test_training_resume_and_replica_check_through_the_launcher(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    """DP 4 with 2 instances trains as without; its checkpoint resumes with one instance."""
    ckpt = str(tmp_path / "ckpt")
    common = {
        "--hidden-dropout": "0.0",
        "--attention-dropout": "0.0",
        "--train-iters": "4",
        "--use-distributed-optimizer": True,
    }
    runs = {
        "plain": {},
        "instances": {
            "--num-distributed-optimizer-instances": "2",
            "--save": ckpt,
            "--exit-interval": "2",
            "--check-weight-hash-across-dp-replicas-interval": "1",
        },
        "resumed": {"--load": ckpt},
    }
    found = {}
    for name, extra in runs.items():
        log = str(tmp_path / f"{name}.jsonl")
        args = base_args(dataset_prefix, tokenizer_model, **common, **extra, **{"--log-jsonl": log})
        pretrain(4, args)
        found[name] = losses(log)
        if name == "instances":
            out = capfd.readouterr().out
            assert "weights equal across data-parallel replicas at 2" in out
    assert latest(ckpt) == "2"
    assert sorted(found["plain"]) == [1, 2, 3, 4]
    assert sorted(found["instances"]) == [1, 2] and sorted(found["resumed"]) == [3, 4]
    for name in ("instances", "resumed"):
        for step, loss in found[name].items():
            reference = found["plain"][step]
            assert abs(loss - reference) <= 1e-5 * reference, (name, step, loss, reference)


@pytest.mark.parametrize(
    "extra, world, problem",
    [
        (["--num-distributed-optimizer-instances", "2"], 4, "needs --use-distributed-optimizer"),
        (
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"],
            4,
            "--num-distributed-optimizer-instances 3 must divide data-parallel x "
            "context-parallel size 4",
        ),
        (
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "0"],
            4,
            "must be at least 1",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line(dataset_prefix, tokenizer_model, extra, world, problem):
    args = base_args(dataset_prefix, tokenizer_model) + extra
    with pytest.raises(ConfigError, match=problem):
        prepare(parse(args), world)
