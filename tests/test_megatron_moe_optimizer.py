"""Adam's state of Megatron-LM mixture-of-experts checkpoints read into ours.

megatron-core 0.16.1 builds its MoE GPT models (tests/test_megatron_moe_checkpoint.py's rig) on
CPU gloo ranks, wraps them in its DistributedDataParallel with the distributed optimizer
(several buckets), and takes two Adam steps on known gradients, written into its own gradient
buffers and reduced by it (tests/test_megatron_distributed_optimizer.py's method). Adam's
moments after two steps are then known exactly; the rig saves them as the model's weights of two
more checkpoints, so that megatron-core itself lays them out, and the state we read must equal
what we read of those as weights. Layouts: megatron-core's chained optimizers of expert
parallelism (dense and expert buckets, `dp_reshardable`) under TP 2 x EP 2 x ETP 2 with shared
experts; one optimizer holding the experts in its buckets (EP 1), per-layer keys with a dense
layer first; the chained optimizers over two pipeline stages (PP 2 x EP 2: the stage in each
bucket's rank index); and the model-space layout (`fully_reshardable`) of chained
optimizers."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import rel_err, run_ranks
from tests.test_megatron_distributed_optimizer import (
    _gradient,
    _our_tensors,
    convert_the_three,
    distributed_optimizer,
)
from tests.test_megatron_moe_checkpoint import _megatron_moe, _moe_args
from tests.test_megatron_optimizer import _ours_after_one_step
from tools.megatron_cpu import cuda_tensors_on_cpu, cuda_type_names

MOMENTS = {
    "exp_avg": lambda g1, g2: 0.09 * g1 + 0.1 * g2,
    "exp_avg_sq": lambda g1, g2: 0.000999 * g1 * g1 + 0.001 * g2 * g2,
}


def _save(rank, world, root, case, tp, ep, etp, sharding, pp=1):
    from megatron.core import dist_checkpointing, parallel_state

    cuda_tensors_on_cpu()
    cuda_type_names()
    torch.manual_seed(5)
    ddp, optimizer = distributed_optimizer(_megatron_moe(case, tp, ep, etp, pp))
    model = ddp.module
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    # an expert-parallel gradient is scaled by 1/DP and summed over the experts' smaller
    # data-parallel group (megatron-core's DDP): its effective gradient is that share of ours
    dp, expert_dp = world // (tp * pp), world // (ep * (etp or tp) * pp)
    grads, scale = {}, {}
    for step in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for name, param in ddp.module.named_parameters():
            split = getattr(param, "tensor_model_parallel", False)
            routed = ".experts.local_experts." in name
            # (routed experts' local names repeat on each expert-parallel rank)
            seed_rank = (etp_rank if split else 0) + 100 * ep_rank if routed else tp_rank * split
            grads[name, step] = _gradient(name, param.shape, step, seed_rank)
            scale[name] = expert_dp / dp if not getattr(param, "allreduce", True) else 1.0
            param.main_grad.copy_(grads[name, step])
        ddp.start_grad_sync()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]
    buffers = [len(b.buckets) for b in ddp.buffers + ddp.expert_parallel_buffers]

    args = _moe_args(case)
    args.tensor_model_parallel_size, args.expert_model_parallel_size = tp, ep
    args.pipeline_model_parallel_size = pp
    args.expert_tensor_parallel_size = etp or tp
    args.transformer_impl, args.consumed_train_samples = "local", 4
    args.use_distributed_optimizer = True
    common = {"args": args, "iteration": 2, "checkpoint_version": 3.0}
    common["opt_param_scheduler"] = {"num_steps": 4}
    layout = {"singleton_local_shards": False}
    state = model.sharded_state_dict(metadata=layout)
    metadata = {**layout, "distrib_optim_sharding_type": sharding}
    metadata["chained_optim_avoid_prefix"] = True  # as Megatron-LM's checkpointing sets it
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state.update(common)
    path = os.path.join(root, "megatron", "iter_0000002")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)
    for kind, moment in MOMENTS.items():
        with torch.no_grad():
            for name, param in ddp.module.named_parameters():
                g1, g2 = (grads[name, step] * scale[name] for step in (0, 1))
                param.copy_(moment(g1, g2))
        path = os.path.join(root, kind, "iter_0000002")
        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save({**model.sharded_state_dict(metadata=layout), **common}, path)
    return buffers


@pytest.mark.parametrize(
    "case, tp, ep, etp, pp, world, sharding",
    [
        ("shared-gated", 2, 2, 2, 1, 4, "dp_reshardable"),
        ("dense-first", 1, 1, None, 1, 2, "dp_reshardable"),
        ("dense-first", 1, 2, None, 2, 4, "dp_reshardable"),
        ("sigmoid-bias", 1, 2, None, 1, 2, "fully_reshardable"),
    ],
    ids=[
        "chained-tp2-ep2-etp2-dp2",
        "one-optimizer-per-layer-keys-dp2",
        "chained-pp2-ep2",
        "model-space-ep2",
    ],
)
def test_an_moe_checkpoints_adam_state_is_read_per_parameter(
    case, tp, ep, etp, pp, world, sharding, tmp_path
):
    buffers = run_ranks(_save, world, str(tmp_path), case, tp, ep, etp, sharding, pp)
    assert max(n for rank in buffers for n in rank) >= 3  # several buckets were read
    state = convert_the_three(tmp_path)
    experts = [k for k in state if k.startswith("optim/") and ".local_experts.3." in k]
    assert experts  # the last expert's state (a second expert-parallel rank's, with EP 2)
    for kind in MOMENTS:
        expected = _our_tensors(str(tmp_path / f"ours-{kind}"), "model/")
        assert len(expected) > 20
        for key, value in expected.items():
            name = key.removeprefix("model/")
            if name.endswith(".expert_bias"):  # updated by its own rule, not by Adam
                assert f"optim/{name}/{kind}" not in state
                continue
            assert rel_err(state[f"optim/{name}/{kind}"], value) < 1e-7, (key, kind)
    for key, value in state.items():
        name = key.removeprefix("model/")
        if key.startswith("model/") and not name.endswith(".expert_bias"):
            assert torch.equal(state[f"optim/{name}/master"], value), key
    if case != "dense-first" or pp > 1:
        return
    # --load of Megatron-LM's folder under expert parallelism 2 takes the step its conversion
    # takes under the same layout; a fresh optimizer does not (the harness gives each
    # data-parallel rank its own micro-batch: both runs are EP 2 x DP 2 on two ranks)
    results = {}
    ep2 = ["--expert-model-parallel-size", "2", "--micro-batch-size", "1"]
    for name, load, extra in (
        ("direct", str(tmp_path / "megatron"), ep2),
        ("converted", str(tmp_path / "ours-megatron"), ep2),
        ("fresh", str(tmp_path / "megatron"), ep2 + ["--no-load-optim"]),
    ):
        results[name] = run_ranks(_ours_after_one_step, 2, load, extra)[0]

    def error(run: str) -> float:
        # (the direct load pads the vocabulary as Megatron-LM's arguments say: its rows)
        errors = []
        for name, value in results[run].items():
            reference = results["converted"][name]
            rows = min(value.shape[0], reference.shape[0]) if value.dim() else None
            errors.append(rel_err(value[:rows], reference[:rows]))
        return max(errors)

    assert any(".local_experts.1." in name for name in results["direct"])
    assert error("direct") < 1e-6
    assert error("fresh") > 1e-3
