"""What a layout really costs: the engine set up from its flags on gloo ranks, running real
training steps on random tokens, each rank reporting its median step time, the most
activation bytes it held (engine/activation_memory.PeakSavedBytes over the whole step) and
its parameter, gradient and optimizer bytes (engine/planning/state_memory.py). The planner's
predictions are checked against these (tests/test_plan.py, tools/bench_plan.py)."""

from __future__ import annotations

import statistics
import time


def mock_gpt_flags(
    num_layers: int, hidden_size: int, seq_length: int, vocab_size: int, heads: int | None = None
) -> list[str]:
    """engine.pretrain flags of a GPT-2 style model (64-wide heads unless `heads`) on mock
    data with the null tokenizer and no dropout: the runs the planner is measured with."""
    return [
        "--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
        "--num-attention-heads", str(heads or hidden_size // 64),
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--vocab-size", str(vocab_size), "--tokenizer-type", "NullTokenizer",
        "--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0", "--mock-data", "--train-iters", "1000", "--lr", "1e-4",
        "--log-interval", "100000",
    ]  # fmt: skip


def measure_rank(rank: int, world: int, flags: list[str], warmup: int, steps: int) -> dict:
    """Run in each rank (parallel.local_ranks.run_local): {pp_rank, step_s (the slowest rank's
    median), activations, params, grads, optimizer}."""
    import torch
    import torch.distributed as dist

    from engine.planning.bench_setup import sync_device
    from engine.planning.saved_activations import PeakSavedBytes
    from engine.planning.state_memory import held_state_bytes
    from engine.pretrain import parse
    from engine.train.iteration import train_iteration
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState, local_rank_and_size, rank_device

    cfg = prepare(parse(flags), world)
    par = cfg.parallel
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = rank_device(cfg.runtime.device, *local_rank_and_size(), cuda)
    if device.type == "cuda":  # cuda:LOCAL_RANK, as torchrun places the ranks
        torch.cuda.set_device(device)
    state = ParallelState.build(
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        cp=par.context_parallel_size,
        device=device,
        ep=par.expert_model_parallel_size,
        etp=par.expert_tp_size,
    )
    run = setup(cfg, state)
    train, seq = cfg.training, cfg.model.seq_length
    m = train.num_microbatches(state.dp_size, train.global_batch(state.dp_size))
    generator = torch.Generator().manual_seed(1 + state.dp_rank)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (m * train.micro_batch_size, seq + 1), generator=generator
    )
    batches = [
        {"tokens": part[:, :-1].to(state.device), "labels": part[:, 1:].to(state.device)}
        for part in tokens.split(train.micro_batch_size)
    ]
    params = [p for chunk in run.chunks for p in chunk.parameters()]
    times = []
    with PeakSavedBytes(params) as saved:
        for step in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            train_iteration(run, batches)
            run.progress.counters.iteration += 1
            sync_device(state.device)
            elapsed = torch.tensor([time.perf_counter() - start], device=state.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times.append(elapsed.item())
    out = {"pp_rank": state.pp_rank, "step_s": statistics.median(times)}
    out["activations"] = saved.peak
    out.update(held_state_bytes(run.chunks, run.optimizer))
    return out
