"""Megatron-LM's default distributed-optimizer checkpoint (`dp_reshardable`: flat gradient
buckets per tensor- and pipeline-parallel rank) read into ours.

megatron-core 0.16.1 builds its GPT model (tests/test_megatron_checkpoint.py's rig), wraps it in
its DistributedDataParallel with the distributed optimizer (several buckets: overlapped
reduction with a small bucket size), and takes two Adam steps on known gradients (seeded per
parameter, step and tensor-parallel rank, written into megatron-core's own gradient buffers and
reduce-scattered by it). Adam's moments after two steps are then known exactly:
exp_avg = 0.09 g1 + 0.1 g2, exp_avg_sq = 0.000999 g1^2 + 0.001 g2^2. The rig saves the
optimizer with dist_checkpointing as `dp_reshardable`, and saves those expected moments as
the model's weights of two more checkpoints, so that megatron-core itself lays them out: the
state we read must equal what we read of them as weights.

Besides the rig's CUDA stand-ins, these ranks put on the CPU the tensors megatron-core's
optimizer creates with device="cuda" (tests/test_megatron_optimizer.py), make `.cuda()` a no-op
and report CPU tensors under their torch.cuda type names, since the distributed optimizer
accepts only those (its check is by name; nothing else CUDA runs)."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from engine.checkpoint.files import iteration_dir, read_meta
from tests.checkpoint_tensors import checkpoint_tensors
from tests.distributed import rel_err, run_ranks
from tests.test_megatron_checkpoint import _args, _convert, _megatron_model
from tests.test_megatron_optimizer import _ours_after_one_step
from tools.megatron_cpu import cuda_tensors_on_cpu, cuda_type_names


def _gradient(name: str, shape, step: int, tp_rank: int) -> torch.Tensor:
    seed = zlib.crc32(name.encode()) + 7 * step + 1000 * tp_rank
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def distributed_optimizer(model, bf16: bool = False):
    """(megatron-core's DDP, its distributed optimizer) over `model`: Adam, gradients reduced
    in fp32 with overlap into small buckets (several per rank)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        bucket_size=3000,
        grad_reduce_in_fp32=True,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.0,
        use_distributed_optimizer=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    return ddp, get_megatron_optimizer(config, [ddp])


def _save(rank, world, root, style, tp, pp, bf16):
    from megatron.core import dist_checkpointing, parallel_state

    cuda_tensors_on_cpu()
    cuda_type_names()
    torch.manual_seed(5)
    model = _megatron_model(style, tp, pp)
    if bf16:
        model.bfloat16()
        model.config.bf16, model.config.params_dtype = True, torch.bfloat16
    ddp, optimizer = distributed_optimizer(model, bf16)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    grads = {}
    for step in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for name, param in ddp.module.named_parameters():
            split = getattr(param, "tensor_model_parallel", False)
            grads[name, step] = _gradient(name, param.shape, step, tp_rank if split else 0)
            param.main_grad.copy_(grads[name, step])
        ddp.start_grad_sync()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]
    buffers = [len(buffer.buckets) for buffer in ddp.buffers]

    args = _args(style)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.bf16, args.transformer_impl, args.consumed_train_samples = bf16, "local", 4
    common = {"args": args, "iteration": 2, "checkpoint_version": 3.0}
    common["opt_param_scheduler"] = {"num_steps": 4}
    state = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state.update(common)
    path = os.path.join(root, "megatron", "iter_0000002")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)

    expected = {
        "exp_avg": lambda g1, g2: 0.09 * g1 + 0.1 * g2,
        "exp_avg_sq": lambda g1, g2: 0.000999 * g1 * g1 + 0.001 * g2 * g2,
    }
    for kind, moment in expected.items():
        with torch.no_grad():
            for name, param in ddp.module.named_parameters():
                param.copy_(moment(grads[name, 0], grads[name, 1]))
        path = os.path.join(root, kind, "iter_0000002")
        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save({**model.sharded_state_dict(), **common}, path)
    return buffers


def convert_the_three(tmp_path) -> dict[str, torch.Tensor]:
    """Convert the rig's three checkpoints (megatron, exp_avg, exp_avg_sq, each at iteration
    2) into ours-<name>; every tensor of the first, whose Adam step and iteration are 2."""
    for folder in ("megatron", "exp_avg", "exp_avg_sq"):
        (tmp_path / folder / "latest_checkpointed_iteration.txt").write_text("2")
        result = _convert(str(tmp_path / folder), str(tmp_path / f"ours-{folder}"))
        assert result.returncode == 0, result.stderr
    meta = read_meta(iteration_dir(str(tmp_path / "ours-megatron"), 2))
    assert meta["optimizer_step"] == 2 and meta["iteration"] == 2
    return _our_tensors(str(tmp_path / "ours-megatron"), "")


def _our_tensors(root: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` of our converted checkpoint `root` (iteration 2)."""
    return checkpoint_tensors(root, 2, prefix)


@pytest.mark.parametrize(
    "style, tp, pp, bf16",
    [("llama", 2, 1, True), ("gpt", 1, 2, False), ("gpt-qkln", 2, 2, True)],
    ids=["llama-tp2-dp2-bf16", "gpt-tied-pp2-dp2", "gpt-qkln-tp2-pp2-dp2-bf16"],
)
def test_dp_reshardable_adam_state_is_read_per_parameter(style, tp, pp, bf16, tmp_path):
    """llama: TP splits of GQA's fused QKV and SwiGLU's fc1, bf16 weights with fp32 masters;
    gpt: biases, LayerNorm, learned positions and the word embeddings tied across two stages
    (each in a bucket of its own); gpt-qkln: LayerNorm on queries and keys, under TP 2 x PP 2
    (four model-parallel ranks' buckets). All: several buckets per rank, DP 2."""
    buffers = run_ranks(_save, tp * pp * 2, str(tmp_path), style, tp, pp, bf16)
    assert max(n for rank in buffers for n in rank) >= 3  # several buckets were read
    state = convert_the_three(tmp_path)
    weights = {k: v for k, v in state.items() if k.startswith("model/")}
    assert len(weights) > 10
    for kind in ("exp_avg", "exp_avg_sq"):
        expected = _our_tensors(str(tmp_path / f"ours-{kind}"), "model/")
        for key, value in expected.items():
            name = key.removeprefix("model/")
            read = state[f"optim/{name}/{kind}"]
            # bf16: the expected moments went through the bf16 weights
            assert rel_err(read, value.float()) < (4e-3 if bf16 else 1e-7), (name, kind)
    for key, value in weights.items():
        master = state[f"optim/{key.removeprefix('model/')}/master"]
        assert master.dtype == torch.float32 and torch.equal(master.to(value.dtype), value), key
    if bf16:  # the masters hold more than the bf16 weights
        assert any(
            not torch.equal(state[f"optim/{k.removeprefix('model/')}/master"], v.float())
            for k, v in weights.items()
        )
        return

    # --load of Megatron-LM's folder under another layout (PP 2 over 2 ranks) and of its
    # conversion (one rank) take the same step; a fresh optimizer does not
    results = {}
    for name, load, extra in (
        ("direct", str(tmp_path / "megatron"), ["--pipeline-model-parallel-size", "2"]),
        ("converted", str(tmp_path / "ours-megatron"), []),
        ("fresh", str(tmp_path / "megatron"), ["--no-load-optim"]),
    ):
        world = 2 if extra[:1] == ["--pipeline-model-parallel-size"] else 1
        results[name] = run_ranks(_ours_after_one_step, world, load, extra)[0]

    def error(run: str, name: str) -> float:
        # (the direct load pads the vocabulary as Megatron-LM's arguments say; compare its rows)
        value, reference = results[run][name], results["converted"][name]
        rows = min(value.shape[0], reference.shape[0]) if value.dim() else None
        return rel_err(value[:rows], reference[:rows])

    # (the direct run's first stage: the embeddings and layer 0)
    assert sorted(results["direct"]) == ["embedding.position_embeddings.weight",
        "embedding.word_embeddings.weight"] + sorted(n for n in results["converted"] if
        n.startswith("layers.0."))  # fmt: skip
    assert max(error("direct", name) for name in results["direct"]) < 1e-6
    assert max(error("fresh", name) for name in results["converted"]) > 1e-3


def test_a_bucket_layout_that_does_not_match_is_refused(tmp_path):
    """The same checkpoint said to come from TransformerEngine's layers (whose norms are
    registered in another order): the buckets no longer line up with the weights, and the
    conversion stops in one line naming --no-load-optim, writing nothing."""
    run_ranks(_save, 2, str(tmp_path), "gpt", 1, 1, False)
    folder = tmp_path / "megatron" / "iter_0000002"
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("2")
    common = torch.load(folder / "common.pt", weights_only=False)  # the test's own file
    common["args"].transformer_impl = "transformer_engine"
    torch.save(common, folder / "common.pt")
    result = _convert(str(tmp_path / "megatron"), str(tmp_path / "ours"))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "dp_reshardable" in line and "--no-load-optim" in line, line
    assert not (tmp_path / "ours").exists()
    result = _convert(str(tmp_path / "megatron"), str(tmp_path / "ours"), ["--no-load-optim"])
    assert result.returncode == 0, result.stderr
