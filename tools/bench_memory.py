"""Memory per rank, measured on CPU gloo ranks and set against its formula.

Model state: the bytes of parameters, gradients and optimizer state a rank holds after a
training step (bf16 parameters, Adam, then Muon with AdamW for the rest), for each
--data-parallel-sharding-strategy at DP 1, 2 and 4, counted from the tensors' storages
(engine/planning/state_memory.py) against the planner's count of the model's parameters times
18, 6 + 12/d, 2 + 16/d and 18/d bytes per parameter (Muon's weights: 4 bytes less, 4/d
sharded).

Activations: activation memory of one transformer layer (the bytes autograd saves for backward, read
with saved-tensor hooks) for TP 1, 2 and 4, with and without sequence parallelism, against
Korthikanti et al.'s count and the same count adjusted for this engine's layer (see
engine/planning/saved_activations.py for the terms). bf16 activations, GPT-2 style layer, flash SDPA
without attention dropout, hidden dropout 0.1.

Context parallelism: activation bytes of one Llama-style layer (RoPE, RMSNorm, SwiGLU, GQA)
per CP rank at 8K and 32K tokens per sample, CP 1, 2 and 4, for each --cp-comm-type, against
CP 1's bytes / C. allgather runs at the shorter length only: on CPU, torch's attention with a
mask falls back to the explicit [heads, s/C, s] probabilities, which is what it measures.

Multi-latent attention: activation bytes of one layer with DeepSeek-V3's attention against a
grouped-query layer of the same hidden size, with and without --recompute-modules mla_up_proj,
at TP 1 and TP 2 with SP, against the planner's count.

Prints tables and writes JSON.
"""

from __future__ import annotations

import json

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.planning.saved_activations import (
    korthikanti_bytes,
    layer_activation_bytes,
    measure_layer,
    measure_layer_context_parallel,
)
from parallel.local_ranks import run_local
from parallel.state import ParallelState

TP_SIZES = (1, 2, 4)


def _measure(rank, world, args):
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        max_position_embeddings=args.seq_length,
        vocab_size=1024,
        hidden_dropout=0.1,
        attention_dropout=0.0,
    )
    rows = []
    for tp in TP_SIZES:
        state = ParallelState.build(tp=tp)
        for sp in (False, True) if tp > 1 else (False,):
            rows.append((tp, sp, measure_layer(cfg, state.tp_group, tp, sp, args.micro_batch_size)))
    return rows


CP_SIZES = (1, 2, 4)


def _cp_cases(args) -> list[tuple[int, str]]:
    """(sequence length, comm type) measured at every CP size above 1."""
    cases = [(seq, comm) for seq in args.cp_seq_lengths for comm in ("p2p", "a2a")]
    return cases + [(min(args.cp_seq_lengths), "allgather")]


def _measure_context_parallel(rank, world, args):
    import torch

    torch.set_num_threads(1)
    state = ParallelState.build(cp=world)
    rows = []
    for seq, comm in _cp_cases(args) if world > 1 else [(s, "-") for s in args.cp_seq_lengths]:
        cfg = ModelConfig(
            num_layers=1,
            hidden_size=args.cp_hidden_size,
            num_attention_heads=8,
            group_query_attention=True,
            num_query_groups=4,
            seq_length=seq,
            max_position_embeddings=seq,
            vocab_size=1024,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=False,
        )
        measured = measure_layer_context_parallel(cfg, state, "p2p" if comm == "-" else comm, 1)
        rows.append((seq, comm, measured))
    return rows


def _context_parallel_table(args) -> list[dict]:
    mib = 2**20
    print(
        f"Context parallelism: activation bytes saved per layer and rank, Llama-style layer, "
        f"hidden {args.cp_hidden_size}, 8 heads, 4 key/value groups, micro-batch 1, bf16 "
        "(largest rank shown)"
    )
    print("| seq | CP | comm type | measured MiB | CP 1 / C MiB | measured / expected |")
    print("| --- | --- | --- | --- | --- | --- |")
    whole, table = {}, []
    for cp in CP_SIZES:
        per_rank = run_local(_measure_context_parallel, cp, args, timeout=1800)
        for index, (seq, comm, _) in enumerate(per_rank[0]):
            measured = max(rows[index][2] for rows in per_rank)
            if cp == 1:
                whole[seq] = measured
            expected = whole[seq] / cp
            table.append({"seq": seq, "cp": cp, "comm_type": comm, "measured": measured})
            print(
                f"| {seq} | {cp} | {comm} | {measured / mib:.1f} | {expected / mib:.1f} | "
                f"{measured / expected:.3f} |"
            )
    return table


LATENT_CASES = {  # DeepSeek-V3's proportions at hidden 512 (it: 7168, 128 heads)
    "GQA (8 heads of 64, 2 key/value groups)": dict(
        group_query_attention=True, num_query_groups=2
    ),
    "MLA (q latent 192, kv latent 64, heads 64+32 / 64)": dict(
        multi_latent_attention=True, q_lora_rank=192, kv_lora_rank=64, qk_head_dim=64,
        qk_pos_emb_head_dim=32, v_head_dim=64, qk_layernorm=True,
    ),
}  # fmt: skip
LATENT_RECOMPUTE = {
    "none": {},
    "mla_up_proj": dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
}


def _latent_configs(args):
    """(attention, recomputation, config) of every latent-attention comparison row."""
    out = []
    for name, attention in LATENT_CASES.items():
        for recompute, options in LATENT_RECOMPUTE.items():
            if recompute != "none" and "multi_latent_attention" not in attention:
                continue
            cfg = ModelConfig(
                num_layers=1, hidden_size=512, num_attention_heads=8,
                seq_length=args.seq_length, max_position_embeddings=args.seq_length,
                vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, **attention, **options,
            )  # fmt: skip
            out.append((name, recompute, cfg))
    return out


def _measure_latent(rank, world, args):
    state = ParallelState.build(tp=world)
    sp = world > 1
    return [
        measure_layer(cfg, state.tp_group, world, sp, args.micro_batch_size)
        for _, _, cfg in _latent_configs(args)
    ]


def _latent_table(args) -> list[dict]:
    from engine.planning.activations import layers_activation_bytes

    mib = 2**20
    print(
        f"Multi-latent against grouped-query attention: activation bytes per layer and rank, "
        f"hidden 512, s={args.seq_length} b={args.micro_batch_size}, bf16, SwiGLU MLP "
        "(the planner's count: engine/planning/activations.py)"
    )
    print("| attention | recompute | TP (SP) | measured MiB | planner MiB | measured / planner |")
    print("| --- | --- | --- | --- | --- | --- |")
    table = []
    for tp in (1, 2):
        measured = run_local(_measure_latent, tp, args)[0]
        for (name, recompute, cfg), value in zip(_latent_configs(args), measured, strict=True):
            planned = layers_activation_bytes(cfg, 1, tp, tp > 1, args.micro_batch_size)
            table.append(
                {"attention": name, "recompute": recompute, "tp": tp}
                | {"measured": value, "planner": planned}
            )
            print(
                f"| {name} | {recompute} | {tp} | {value / mib:.2f} | {planned / mib:.2f} | "
                f"{value / planned:.3f} |"
            )
    return table


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OPTIMIZERS = ("adam", "muon")
DP_SIZES = (1, 2, 4)


def _measure_states(rank, world, args):
    import torch

    from engine.model.builder import build_model_chunks
    from engine.optim.lr_schedule import LRScheduler
    from engine.optim.optimizer import build_optimizer
    from engine.planning.state_memory import held_state_bytes
    from engine.train.step import train_step
    from parallel.data_parallel.ddp import DistributedDataParallel

    state = ParallelState.build(tp=1)
    cfg = _state_config(args)
    tokens = torch.randint(0, 1024, (2 * world, 65), generator=torch.Generator().manual_seed(0))
    mine = tokens[2 * rank : 2 * rank + 2]
    batches = [{"tokens": mine[:, :-1], "labels": mine[:, 1:]}]
    rows = []
    for optimizer_name, strategy in [(o, s) for o in OPTIMIZERS for s in STRATEGIES]:
        ocfg = OptimizerConfig(optimizer=optimizer_name, lr=1e-4, lr_decay_style="constant")
        chunks = build_model_chunks(cfg, state, params_dtype=torch.bfloat16)
        ddps = [DistributedDataParallel(c, state.dp_group, sharding=strategy) for c in chunks]
        optimizer = build_optimizer(
            ddps,
            ocfg,
            use_distributed_optimizer=strategy != "no_shard",
            fp16=False,
            tp_rank=0,
            model_parallel_group=state.model_parallel_group,
            instance_group=state.optimizer_instance_group,
            device=state.device,
        )
        train_step(ddps, optimizer, LRScheduler(ocfg, 10), batches, state)
        optimizer.finish_param_sync()
        count = sum(p.numel() for d in ddps for p in d.params)
        rows.append((optimizer_name, strategy, count, held_state_bytes(ddps, optimizer)))
    return rows


def _state_config(args) -> ModelConfig:
    """The model whose state is measured: GPT-2 style, 4 heads."""
    return ModelConfig(
        num_layers=args.state_layers,
        hidden_size=args.state_hidden_size,
        num_attention_heads=4,
        seq_length=64,
        max_position_embeddings=64,
        vocab_size=1024,
        make_vocab_size_divisible_by=1,
    )


def _state_table(args) -> list[dict]:
    from engine.planning.memory import Layout, rank_state_bytes
    from engine.planning.state_memory import KINDS

    mib = 2**20
    print(
        f"Model state held per rank after a step: {args.state_layers} layers, hidden "
        f"{args.state_hidden_size}, bf16 parameters, Adam or Muon (with AdamW for the rest; "
        "the mean over the ranks); formula: the planner's (engine/planning/memory.py)"
    )
    print(
        "| optimizer | strategy | DP | params MiB | grads MiB | optimizer MiB | bytes/param "
        "measured | formula | measured / formula |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    table, cfg = [], _state_config(args)
    for dp in DP_SIZES:
        per_rank = run_local(_measure_states, dp, args)
        for index, (name, strategy, count, _) in enumerate(per_rank[0]):
            # the mean rank: with Muon a rank's shards hold more or fewer Muon weights (8
            # bytes of state) against Adam's (12) than another's; the planner's is the mean
            mean = {k: sum(r[index][3][k] for r in per_rank) / dp for k in KINDS}
            measured = sum(mean.values()) / count
            layout = Layout(dp=dp, strategy=strategy, optimizer=name)
            formula = sum(rank_state_bytes(cfg, layout, 0).values()) / count
            table.append(
                {"optimizer": name, "strategy": strategy, "dp": dp, "parameters": count}
                | {"bytes": mean, "formula": formula}
            )
            print(
                f"| {name} | {strategy} | {dp} | "
                + " | ".join(f"{mean[k] / mib:.2f}" for k in KINDS)
                + f" | {measured:.2f} | {formula:.2f} | {measured / formula:.3f} |"
            )
    return table


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--state-layers", type=int, default=4)
    parser.add_argument("--state-hidden-size", type=int, default=256)
    parser.add_argument("--cp-seq-lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--cp-hidden-size", type=int, default=256)
    parser.add_argument("--json", default="bench_memory.json")
    args = parser.parse_args(argv)
    latent = _latent_table(args)
    print()
    states = _state_table(args)
    print()
    context_parallel = _context_parallel_table(args)
    print()
    s, b, h, a = args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads
    rows = run_local(_measure, max(TP_SIZES), args)[0]
    mib = 2**20
    print(f"Activation bytes saved for backward per layer and rank: s={s} b={b} h={h} a={a}, bf16")
    print("| TP | SP | measured MiB | adjusted formula MiB | measured / formula | paper MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    table = []
    for tp, sp, measured in rows:
        formula = layer_activation_bytes(s, b, h, a, tp, sp)
        paper = korthikanti_bytes(s, b, h, a, tp, sp)
        table.append({"tp": tp, "sp": sp, "measured": measured, "formula": formula, "paper": paper})
        print(
            f"| {tp} | {'yes' if sp else 'no'} | {measured / mib:.2f} | {formula / mib:.2f} | "
            f"{measured / formula:.3f} | {paper / mib:.2f} |"
        )
    with open(args.json, "w") as f:
        shape = {"s": s, "b": b, "h": h, "a": a}
        record = {"states": states, "activations": table, "shape": shape}
        record |= {"context_parallel": context_parallel, "latent_attention": latent}
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    run(main)
