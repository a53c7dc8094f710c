"""Megatron-LM's Adam state read from its torch_dist checkpoint: megatron-core 0.16.1 trains its
Llama-style GPT model (tests/test_megatron_checkpoint.py's rig) with its own optimizer
(get_megatron_optimizer, Adam, no distributed optimizer), saves model and optimizer after two
steps and takes a third; --load of that checkpoint here (under PP 2), and of its conversion,
takes the same third step to the same weights, which a fresh optimizer does not.

Besides the rig's CUDA stand-ins, the ranks that run megatron-core's optimizer put on the CPU
the few tensors its optimizer and DDP wrapper create with device="cuda" (torch.tensor, zeros,
empty, ...), and gradient clipping is off (megatron-core's clipping asserts CUDA tensors).
The distributed optimizer's default layout is tested in
tests/test_megatron_distributed_optimizer.py."""

from __future__ import annotations

import os

import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.config.model import ModelConfig
from engine.interop.megatron.layout import join_parts
from tests.distributed import rel_err, run_ranks
from tests.harness import engine_steps
from tests.test_megatron_checkpoint import SEQ, VOCAB, _args, _convert, _megatron_model
from tools.megatron_cpu import cuda_tensors_on_cpu

LR = 1e-3


def _tokens() -> torch.Tensor:
    # the batch tests.harness.engine_steps trains on (data-parallel rank 0)
    return torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _train_save_and_step(rank, world, path):
    """Two Adam steps, save (model, optimizer, arguments, iteration 2), a third step; returns
    the weights after the third."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.manual_seed(5)
    model = _megatron_model("llama", 1, 1)
    cuda_tensors_on_cpu()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [ddp])
    # what Megatron-LM's OptimizerParamScheduler sets at every step: each group's weight
    # decay times its wd_mult (0 for biases and norm weights, 1-D parameters)
    for group in optimizer.param_groups:
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
    tokens = _tokens()
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    positions = torch.arange(SEQ)[None].expand(2, SEQ)

    def step():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens[:, :-1], positions, attention_mask=mask, labels=tokens[:, 1:])
        loss.float().mean().backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]

    step()
    step()
    state = model.sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(state)
    args = _args("llama")
    args.consumed_train_samples = 4
    state.update({"args": args, "iteration": 2, "checkpoint_version": 3.0})
    state["opt_param_scheduler"] = _megatron_schedule_state()
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)
    step()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "extra" not in k}


def _megatron_schedule_state() -> dict:
    """megatron-core's OptimizerParamScheduler state after the 2 steps of 2 samples, for the
    schedule the resume below runs (tests.harness.engine_steps: --train-iters 4, and the flags
    of `_ours_after_one_step`), built as Megatron-LM's training.py builds it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    group = {"params": [torch.nn.Parameter(torch.zeros(1))], "max_lr": LR, "min_lr": 0.0}
    scheduler = OptimizerParamScheduler(
        torch.optim.SGD([group], lr=LR),
        init_lr=0.0,
        max_lr=LR,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=4 * 2,
        lr_decay_style="constant",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=4 * 2,
        wd_incr_style="constant",
    )
    scheduler.step(2 * 2)
    return scheduler.state_dict()


def _ours_after_one_step(rank, world, load, extra):
    flags = [
        "--load", load, "--use-checkpoint-args", "--lr", str(LR), "--lr-decay-style",
        "constant", "--clip-grad", "0", "--weight-decay", "0.1", "--vocab-size", str(VOCAB),
        "--global-batch-size", "2", *extra,
    ]  # fmt: skip
    _, after, _, _ = engine_steps(rank, world, flags, steps=1)
    return after


def test_adam_state_from_megatron_core_continues_its_training(tmp_path):
    root = tmp_path / "megatron"
    [theirs] = run_ranks(_train_save_and_step, 1, str(root / "iter_0000002"))
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    assert _convert(str(root), str(tmp_path / "ours")).returncode == 0
    meta = read_meta(iteration_dir(str(tmp_path / "ours"), 2))
    assert meta["optimizer_step"] == 2
    cfg = ModelConfig(**meta["model"])

    def error(after: dict) -> float:
        """The largest relative difference of every parameter a run holds from megatron-core's
        after its third step, ours put in its layout (q, k, v fused per query group)."""
        errors = {}
        for name, value in after.items():
            key = name if name.startswith("embedding.") or name == "output_layer.weight" else (
                f"decoder.{name}")  # fmt: skip
            if name.endswith("linear_qkv.weight"):
                n, g, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
                q, k, v = value.split([n * d, g * d, g * d])
                value = join_parts({"q": q, "k": k, "v": v}, cfg)
            # (our embedding and output layer have padding rows past Megatron-LM's 64)
            errors[key] = rel_err(value[: theirs[key].shape[0]], theirs[key])
        return max(errors.values())

    assert len(theirs) >= 15  # every parameter: fused QKV, SwiGLU's fc1, norms, output layer
    results = {}
    for name, load, extra in (
        ("direct", str(root), ["--pipeline-model-parallel-size", "2"]),
        ("converted", str(tmp_path / "ours"), []),
        ("fresh", str(root), ["--no-load-optim"]),
    ):
        world = 2 if extra[:1] == ["--pipeline-model-parallel-size"] else 1
        results[name] = run_ranks(_ours_after_one_step, world, load, extra)[0]
    assert len(results["converted"]) == len(theirs)  # one rank: all of them
    assert error(results["direct"]) < 1e-5  # (PP 2: the first stage's)
    assert error(results["converted"]) < 1e-5
    # a fresh Adam's first step differs: the test sees the loaded state
    assert error(results["fresh"]) > 1e-3
    # its schedule state compared as megatron-core compares it: another --lr is refused
    try:
        run_ranks(_ours_after_one_step, 1, str(root), ["--lr", "2e-3"])
        refused = ""
    except AssertionError as err:
        refused = str(err)
    assert "--lr: the schedule's max_lr is 0.002 here and 0.001 in Megatron-LM's" in refused


def test_optimizer_state_in_an_older_bucket_layout_is_refused(tmp_path):
    """The distributed optimizer's older dp_zero_gather_scatter layout: one line, exit 2, the
    fix; with that fix (--no-load-optim) the weights convert."""
    root = tmp_path / "megatron"
    folder = root / "iter_0000002"
    run_ranks(_train_save_and_step, 1, str(folder))
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    common = torch.load(folder / "common.pt", weights_only=False)  # the test's own file
    common["optimizer"] = {"param_state_sharding_type": "dp_zero_gather_scatter", "optimizer": {}}
    torch.save(common, folder / "common.pt")
    result = _convert(str(root), str(tmp_path / "ours"))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "'dp_zero_gather_scatter'" in line and "--dist-ckpt-optim-fully-reshardable" in line
    assert "--no-load-optim" in line and not (tmp_path / "ours").exists()
    result = _convert(str(root), str(tmp_path / "ours"), ["--no-load-optim"])
    assert result.returncode == 0, result.stderr
    meta = read_meta(iteration_dir(str(tmp_path / "ours"), 2))
    assert meta["optimizer_step"] == 0 and meta["iteration"] == 2
    # chained optimizers (MoE, or overlapped parameter gathers) keep one state per optimizer
    common["optimizer"] = {0: {"optimizer": {}}, 1: {"optimizer": {}}}
    torch.save(common, folder / "common.pt")
    result = _convert(str(root), str(tmp_path / "chained"))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "chained optimizers" in line and "--no-load-optim" in line
