"""tripod and megatron-core 0.16.1 training the same model from the same weights on the same
batches, layout by layout, on gloo ranks (tools/bench_vs_megatron.py --layouts).

megatron-core builds the model (its local layer spec: no Transformer Engine) and saves its
initial weights as a Megatron-LM torch_dist checkpoint with the arguments Megatron-LM keeps in
it; tripod starts from that checkpoint (--load with --use-checkpoint-args --finetune, its
Megatron-LM reader). Both then take the same steps, Adam at a constant learning rate with
weight decay on the weights Megatron-LM decays (no gradient clipping: megatron-core's clipping
asserts CUDA tensors), in fp32 or bf16 (Float16Module and fp32 main weights and gradients on
megatron-core's side, --bf16 on tripod's), each data-parallel rank the same micro-batches on
both sides, read from one indexed dataset. megatron-core runs its own schedules
(get_forward_backward_func: no pipelining, or 1F1B), DDP, distributed optimizer and MoE token
dispatcher, in processes of its own with the stand-ins of tools/megatron_cpu.py. The first step
of each is also the memory step (engine/planning/live_memory.py, the same count for both); the
others are timed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

LR, WEIGHT_DECAY, SEED = 3e-4, 0.1, 1234


@dataclass(frozen=True)
class Case:
    """A layout both engines run: its ranks and megatron-core's sizes."""

    name: str
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    distributed_optimizer: bool = False
    moe: bool = False

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


CASES = {
    "tp1": Case("tp1", 1),
    "tp2-sp": Case("tp2-sp", 2, tp=2, sp=True),
    "pp2-1f1b": Case("pp2-1f1b", 2, pp=2),
    "dp2-distopt": Case("dp2-distopt", 2, distributed_optimizer=True),
    "ep2-moe": Case("ep2-moe", 2, ep=2, moe=True),
}


@dataclass(frozen=True)
class Shape:
    """A Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases,
    untied embeddings), the batch (micro-batches per step on each data-parallel rank) and the
    precision."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    microbatches: int
    padded_vocab_size: int
    num_experts: int = 4
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 2
    bf16: bool = False  # bf16 weights and activations, fp32 main weights and gradients


def megatron_args(shape: Shape, case: Case) -> argparse.Namespace:
    """Megatron-LM's arguments as its training keeps them in a checkpoint (what tripod's
    --use-checkpoint-args reads), with the megatron-core objects real runs hold."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    moe = {}
    if case.moe:
        moe = dict(
            num_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_router_topk,
            moe_token_dispatcher_type="alltoall",
        )
    return argparse.Namespace(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        group_query_attention=True,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        rotary_base=10000,
        untie_embeddings_and_output_weights=True,
        qk_layernorm=False,
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        exit_signal=signal.SIGTERM,
        kv_channels=shape.hidden_size // shape.num_attention_heads,
        seq_length=shape.seq_length,
        max_position_embeddings=shape.seq_length,
        padded_vocab_size=shape.padded_vocab_size,
        rotary_percent=1.0,
        norm_epsilon=1e-5,
        apply_layernorm_1p=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        consumed_train_samples=0,
        make_vocab_size_divisible_by=128,
        tokenizer_type="NullTokenizer",
        **moe,
    )


def _megatron_model(shape: Shape, case: Case):
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tools.megatron_cpu import CPU_CONFIG

    dtype = torch.bfloat16 if shape.bf16 else torch.float32
    moe = {}
    if case.moe:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_router_topk,
            moe_token_dispatcher_type="alltoall",
            expert_model_parallel_size=case.ep,
        )
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        **CPU_CONFIG,
        bf16=shape.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        sequence_parallel=case.sp,
        **moe,
    )
    if case.moe:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config,
        transformer_layer_spec=spec,
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def _instrument(step: int, profile: bool):
    """Step 0: the memory count; step 1 with `profile`: torch's profiler; else nothing."""
    from engine.planning.live_memory import LiveStoragePeak

    if step == 0:
        return LiveStoragePeak(by_origin=True)
    if step == 1 and profile:
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    return contextlib.nullcontext()


def _top_ops(profiler) -> list[tuple[str, float, int]]:
    """(operation, self CPU ms, calls) of the 15 costliest operations of a profiled step."""
    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in events]


def _measured_steps(batches, profile: bool, take_step) -> dict:
    """`take_step(per_rank)` for each step's batches, every rank starting it together; it
    returns a function giving the step's loss, called once the clock has stopped. The first
    step counts memory, the second is profiled with `profile`, the others are timed."""
    losses, times, memory, profiled = [], [], None, None
    for step, per_rank in enumerate(batches):
        dist.barrier()
        counter = _instrument(step, profile)
        start = time.perf_counter()
        with counter:
            loss_of = take_step(per_rank)
        elapsed = time.perf_counter() - start
        if step == 0:
            memory = counter
        elif step == 1 and profile:
            profiled = _top_ops(counter)
        else:
            times.append(elapsed)
        losses.append(loss_of())
    top = sorted(memory.at_peak.items(), key=lambda kv: -kv[1])[:10]
    return {
        "losses": losses,
        "step_s": times,
        "peak_bytes": memory.peak,
        "at_peak": dict(top),
        "profile": profiled,
    }


def megatron_rank(
    rank, world, case: Case, shape: Shape, batches, checkpoint: str, profile: bool = False
) -> dict:
    """megatron-core on this rank: build, save the initial weights to `checkpoint`, train a
    step per entry of `batches` ([step][data-parallel rank] -> micro-batches of tokens)."""
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tools import megatron_cpu

    megatron_cpu.cuda_queries_on_cpu()
    megatron_cpu.cuda_tensors_on_cpu()
    megatron_cpu.cuda_type_names()
    megatron_cpu.router_without_transformer_engine()
    megatron_cpu.norms_for_sequence_parallelism()
    megatron_cpu.alltoall_dispatcher_on_cpu()
    parallel_state.initialize_model_parallel(case.tp, case.pp, expert_model_parallel_size=case.ep)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    model = _megatron_model(shape, case)
    metadata = {"singleton_local_shards": False} if case.moe else None
    state = model.sharded_state_dict(metadata=metadata)
    state |= {"args": megatron_args(shape, case), "iteration": 0, "checkpoint_version": 3.0}
    folder = os.path.join(checkpoint, "iter_0000000")  # Megatron-LM's layout of a save
    os.makedirs(folder, exist_ok=True)
    dist_checkpointing.save(state, folder)
    if rank == 0:
        with open(os.path.join(checkpoint, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("0")
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=case.distributed_optimizer, grad_reduce_in_fp32=True
    )
    if shape.bf16:  # as Megatron-LM's training wraps a bf16 model
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            clip_grad=0.0,
            use_distributed_optimizer=case.distributed_optimizer,
            bf16=shape.bf16,
            params_dtype=torch.bfloat16 if shape.bf16 else torch.float32,
        ),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    forward_backward = get_forward_backward_func()
    s = shape.seq_length
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
    positions = torch.arange(s)[None].expand(shape.micro_batch_size, s)

    def forward_step(iterator, module):
        tokens = next(iterator)
        output = module(tokens[:, :-1], positions, attention_mask=mask, labels=tokens[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss`

        return output, loss_func

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()

    def take_step(per_rank):
        for group in optimizer.param_groups:  # what OptimizerParamScheduler sets each step
            group["weight_decay"] = WEIGHT_DECAY * group["wd_mult"]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(per_rank[dp_rank]),
            model=[ddp],
            num_microbatches=shape.microbatches,
            seq_length=s,
            micro_batch_size=shape.micro_batch_size,
            forward_only=False,
        )
        updated, _, _ = optimizer.step()
        assert updated, "megatron-core skipped a step"
        return lambda: _megatron_loss(reports, dp_group)

    return _measured_steps(batches, profile, take_step)


def _megatron_loss(reports, dp_group) -> float:
    """The step's loss as Megatron-LM logs it: the micro-batches' mean, averaged over the
    data-parallel ranks (NaN off the last pipeline stage)."""
    from megatron.core import parallel_state

    loss = torch.tensor(float("nan"))
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([r["lm loss"] for r in reports]).mean()
        dist.all_reduce(loss, group=dp_group)
        loss /= dist.get_world_size(dp_group)
    return loss.item()


def tripod_flags(case: Case, shape: Shape, checkpoint: str, steps: int) -> list[str]:
    """engine.pretrain flags of the same run, starting from megatron-core's weights."""
    global_batch = shape.micro_batch_size * shape.microbatches * case.dp
    flags = [
        "--load", checkpoint, "--use-checkpoint-args", "--finetune",
        "--lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", str(WEIGHT_DECAY),
        "--clip-grad", "0", "--micro-batch-size", str(shape.micro_batch_size),
        "--global-batch-size", str(global_batch), "--train-iters", str(steps),
        "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(shape.padded_vocab_size), "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tensor-model-parallel-size", str(case.tp),
        "--pipeline-model-parallel-size", str(case.pp),
        "--expert-model-parallel-size", str(case.ep), "--seed", str(SEED),
    ]  # fmt: skip
    if case.sp:
        flags.append("--sequence-parallel")
    if case.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if shape.bf16:
        flags.append("--bf16")
    return flags


def tripod_rank(
    rank, world, case: Case, shape: Shape, batches, checkpoint: str, profile: bool = False
) -> dict:
    """tripod on this rank: the same steps from megatron-core's initial checkpoint."""
    from engine.pretrain import parse
    from engine.train.iteration import train_iteration
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    cfg = prepare(parse(tripod_flags(case, shape, checkpoint, len(batches))), world)
    state = ParallelState.build(case.tp, case.pp, ep=case.ep)
    run = setup(cfg, state)
    last = state.pp_rank == state.pp_size - 1

    def take_step(per_rank):
        micro = [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in per_rank[state.dp_rank]]
        record = train_iteration(run, micro)
        return lambda: float(record.lm_loss) if last else float("nan")

    return _measured_steps(batches, profile, take_step)


def dataset_batches(prefix: str, shape: Shape, case: Case, steps: int) -> list:
    """[step][data-parallel rank] -> micro-batches ([micro-batch size, seq + 1] tokens): the
    dataset's samples in the order Megatron-LM reads them, each global batch split over the
    data-parallel ranks in turn."""
    import numpy as np

    from engine.data.builder import build_gpt_datasets
    from engine.data.sources import data_sources

    per_rank = shape.micro_batch_size * shape.microbatches
    count = steps * per_rank * case.dp
    train = build_gpt_datasets(
        data_sources([prefix], "100,0,0"), shape.seq_length, SEED, (count, 0, 0), None
    )[0]
    samples = torch.from_numpy(np.stack([train[i] for i in range(count)]).astype(np.int64))
    out = []
    for step in range(steps):
        ranks = []
        for dp_rank in range(case.dp):
            first = (step * case.dp + dp_rank) * per_rank
            mine = samples[first : first + per_rank]
            ranks.append(list(mine.split(shape.micro_batch_size)))
        out.append(ranks)
    return out


def run_case(case: Case, shape: Shape, batches, folder: str, profile: bool = False) -> dict:
    """Both engines on `case.world` gloo ranks: each one's losses (from a last pipeline
    stage), median step seconds and largest peak over the ranks, and their comparison."""
    import statistics

    from parallel.local_ranks import run_local

    checkpoint = os.path.join(folder, case.name)
    engines = {}
    for name, fn in (("megatron", megatron_rank), ("tripod", tripod_rank)):
        results = run_local(fn, case.world, case, shape, batches, checkpoint, profile, timeout=1800)
        last = results[-1]  # the last rank is on the last pipeline stage
        engines[name] = {
            "losses": last["losses"],
            "step_s": statistics.median(max(r["step_s"][k] for r in results)
                                        for k in range(len(last["step_s"]))),
            "peak_bytes": max(r["peak_bytes"] for r in results),
            "at_peak": max(results, key=lambda r: r["peak_bytes"])["at_peak"],
            "profile": last["profile"],
        }  # fmt: skip
    ours, theirs = engines["tripod"], engines["megatron"]
    loss_error = max(
        abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)
    )
    return {
        "layout": case.name,
        "world": case.world,
        "loss_rel_error": loss_error,
        "tripod": ours,
        "megatron": theirs,
        "time_ratio": ours["step_s"] / theirs["step_s"],
        "memory_ratio": ours["peak_bytes"] / theirs["peak_bytes"],
    }
