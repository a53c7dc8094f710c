"""Shared pieces for the training-parity tests: a tiny model, deterministic global batches,
a single-process reference run, and the same run through the parallel engine."""

from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model import BuildContext, GPTModel
from engine.model.builder import build_model_chunks
from engine.monitor.grad_norm_parts import grad_norm_parts
from engine.monitor.noise_scale import LocalGradSquares
from engine.optim.lr_schedule import LRScheduler
from engine.optim.optimizer import build_optimizer, no_weight_decay
from engine.train.loss import LossReduction
from engine.train.step import StepFeatures, run_schedule, train_step
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.expert_parallel.params import is_expert_parallel
from parallel.grads import finalize_model_grads
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.tables import PLACEMENT
from parallel.tensor_parallel.sharding import full_from_local, tp_sharding_of

VOCAB = 300


def tiny_config(style: str = "gpt2", **overrides) -> ModelConfig:
    common = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if style == "llama":
        common.update(
            group_query_attention=True,
            num_query_groups=2,
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=False,
            untie_embeddings_and_output_weights=True,
        )
    common.update(overrides)
    return ModelConfig(**common)


def opt_config(**overrides) -> OptimizerConfig:
    # adam_eps 1e-6: the attention key bias has an exactly-zero true gradient (softmax ignores
    # a shift shared by all keys); with eps 1e-8 Adam turns its ~1e-10 rounding noise into
    # lr-sized steps, which no two summation orders reproduce.
    base = dict(lr=1e-3, lr_decay_style="constant", weight_decay=0.1, clip_grad=0.5, adam_eps=1e-6)
    base.update(overrides)
    return OptimizerConfig(**base)


def global_batch(step: int, size: int, seq: int) -> torch.Tensor:
    """The global batch of a step: [size, seq + 1] token ids, the same on every rank."""
    return torch.randint(0, VOCAB, (size, seq + 1), generator=torch.Generator().manual_seed(step))


def micro_batches(tokens: torch.Tensor, mbs: int, dp_rank: int, dp_size: int) -> list[dict]:
    """This DP rank's micro-batches, as PretrainingSampler hands them out."""
    out = []
    for start in range(0, tokens.shape[0], mbs * dp_size):
        piece = tokens[start + dp_rank * mbs : start + (dp_rank + 1) * mbs]
        out.append({"tokens": piece[:, :-1], "labels": piece[:, 1:]})
    return out


def reference_run(
    cfg: ModelConfig,
    ocfg: OptimizerConfig,
    steps: int,
    gbs: int,
    dtype=torch.float32,
    seed: int = 1234,
):
    """Single process, plain torch: one forward over the global batch, AdamW, clipping."""
    model = GPTModel(cfg, BuildContext(cfg, params_dtype=dtype, seed=seed))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    groups = [
        {
            "params": [p for p in params if not no_weight_decay(p)],
            "weight_decay": ocfg.weight_decay,
        },
        {"params": [p for p in params if no_weight_decay(p)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=ocfg.lr, betas=(ocfg.adam_beta1, ocfg.adam_beta2), eps=ocfg.adam_eps
    )
    scheduler = LRScheduler(ocfg, steps, gbs)
    losses, norms = [], []
    for step in range(steps):
        tokens = global_batch(step, gbs, cfg.seq_length)
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, ocfg.clip_grad).item())
        for group in optimizer.param_groups:
            group["lr"] = scheduler.lr_at(step)  # every update succeeds: update k is step k
        optimizer.step()
        losses.append(loss.item())
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, norms, final, initial


def engine_run(
    state,
    cfg,
    ocfg,
    steps,
    gbs,
    mbs,
    *,
    zero=False,
    sharding=None,
    overlap=False,
    overlap_param_gather=False,
    bucket_size=2000,
    sequence_parallel=False,
    dtype=torch.float32,
    fp16=False,
    schedule_kind=None,
    virtual_size=1,
    hook=None,
    seed: int = 1234,
    first_stage_layers=None,
    last_stage_layers=None,
    repeat_batch: bool = False,
    torch_compile: bool = False,
    cp_comm_type=("p2p",),
    part_norms: bool = False,
    local_squares: bool = False,
    counts: bool = False,
    first_grads: dict | None = None,
):
    """The same run through DDP + DistributedOptimizer + the pipeline schedule; `sharding`
    (a strategy of parallel/data_parallel/ddp.py) overrides `zero`.
    repeat_batch: train on one batch over and over (a loss that can fall).
    part_norms: each step also reports the gradient norm per layer and parameter group;
    local_squares: and the DP ranks' mean squared norm of their own gradients;
    counts: the gradient's zeros and the parameters' norm (--log-num-zeros-in-grad,
    --log-params-norm); first_grads: filled with every gradient this rank holds after the
    first step's reduction, at full (TP=1) shape (unsharded gradients only: no_shard)."""
    chunks = build_model_chunks(
        cfg,
        state,
        params_dtype=dtype,
        seed=seed,
        sequence_parallel=sequence_parallel,
        virtual_size=virtual_size,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        torch_compile=torch_compile,
        cp_comm_type=cp_comm_type,
        placement=PLACEMENT.get(schedule_kind, "loop"),
    )
    # the experts' buffers over the expert DP group
    experts_apart = state.ep_size > 1 or state.etp_size != state.tp_size
    experts = {"expert_dp_group": state.expert_dp_group} if experts_apart else {}
    ddps = [
        DistributedDataParallel(
            c,
            state.dp_cp_shard_group,
            replica_group=state.dp_cp_replica_group,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=zero,
            sharding=sharding,
            overlap_param_gather=overlap_param_gather,
            **experts,
        )
        for c in chunks
    ]
    optimizer = build_optimizer(
        ddps,
        ocfg,
        use_distributed_optimizer=ddps[0].use_distributed_optimizer,
        fp16=fp16,
        tp_rank=state.tp_rank,
        model_parallel_group=state.model_parallel_group,
        instance_group=state.optimizer_instance_group,
        device=state.device,
        experts_apart=experts_apart,
        expert_norm_group=state.expert_tp_ep_pp_group,
    )
    scheduler = LRScheduler(ocfg, steps, gbs)
    schedule = make_schedule(state, cfg, mbs, sequence_parallel, dtype, virtual_size, schedule_kind)
    outputs = []
    for step in range(steps):
        tokens = global_batch(0 if repeat_batch else step, gbs, cfg.seq_length)
        batches = micro_batches(tokens, mbs, state.dp_rank, state.dp_size)
        if hook is not None:
            hook(step, ddps, optimizer)
        parts = grad_norm_parts(cfg, ddps) if part_norms else None
        own = LocalGradSquares(ddps, state.tp_rank) if local_squares else None
        outputs.append(
            train_step(
                ddps,
                optimizer,
                scheduler,
                batches,
                state,
                schedule,
                features=StepFeatures(
                    norm_parts=parts, local_squares=own, num_zeros=counts, params_norm=counts
                ),
            )
        )
        if step == 0 and first_grads is not None:
            first_grads.update(full_grads(ddps, state))
    optimizer.finish_param_sync()
    return outputs, ddps, optimizer


def make_schedule(
    state,
    cfg,
    mbs,
    sequence_parallel=False,
    dtype=torch.float32,
    virtual_size=1,
    kind=None,
    stats=None,
    overlap_p2p=False,
    trace=False,
):
    seq = cfg.seq_length // state.cp_size
    if sequence_parallel and state.tp_size > 1:
        seq //= state.tp_size
    return get_schedule(
        state,
        virtual_size=virtual_size,
        kind=kind,
        tensor_shape=(seq, mbs, cfg.hidden_size),
        dtype=dtype,
        stats=stats,
        overlap_p2p=overlap_p2p,
        trace=trace,
    )


def engine_grads(
    state,
    cfg,
    tokens,
    mbs,
    *,
    schedule_kind=None,
    virtual_size=1,
    sequence_parallel=False,
    stats=None,
    overlap_p2p=False,
    cp_comm_type=("p2p",),
    trace=False,
    first_stage_layers=None,
    last_stage_layers=None,
    packing=None,
    per_token_loss=False,
    stage_counts=None,
):
    """One forward/backward of the global batch through the engine: (losses, full grads).
    Under context parallelism the losses are this CP rank's shares. `trace`: stats get the
    runtime's 'events'. `packing`: engine/data/documents.py's, applied to every micro-batch
    as the loop does."""
    chunks = build_model_chunks(
        cfg,
        state,
        sequence_parallel=sequence_parallel,
        virtual_size=virtual_size,
        cp_comm_type=cp_comm_type,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        stage_counts=stage_counts,
        placement=PLACEMENT.get(schedule_kind, "loop"),
    )
    ddps = [DistributedDataParallel(c, state.dp_cp_group, bucket_size=2000) for c in chunks]
    schedule = make_schedule(
        state,
        cfg,
        mbs,
        sequence_parallel,
        torch.float32,
        virtual_size,
        schedule_kind,
        stats,
        overlap_p2p,
        trace,
    )
    batches = micro_batches(tokens, mbs, state.dp_rank, state.dp_size)
    if packing is not None:
        batches = [packing.annotate(b) for b in batches]
    for ddp in ddps:
        ddp.zero_grad_buffer()
    masked = packing is not None and packing.eod_mask_loss
    reduction = LossReduction(per_token=per_token_loss, masked=masked)
    losses = run_schedule(ddps, batches, schedule, state=state, reduction=reduction)
    shared = [w for d in ddps if (w := d.module.shared_embedding_weight()) is not None]
    finalize_model_grads(ddps, state.tp_group, state.embedding_group, shared)
    grads = {}
    for ddp in ddps:
        for name, param in ddp.module.named_parameters():
            name = getattr(param, "checkpoint_name", name)
            grads[name] = full_from_local(param.main_grad, tp_sharding_of(param), state.tp_group)
    return losses, grads


def reference_grads(cfg, tokens, seed: int = 1234):
    model = GPTModel(cfg, BuildContext(cfg, seed=seed))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def full_params(ddps, state) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, gathered back to its full (TP=1) shape."""
    out = {}
    for ddp in ddps:
        with ddp.gathered_parameters():
            for name, param in ddp.module.named_parameters():
                name = getattr(param, "checkpoint_name", name)
                local = param.data.clone()
                group = state.expert_tp_group if is_expert_parallel(param) else state.tp_group
                out[name] = full_from_local(local, tp_sharding_of(param), group)
    return out


def full_grads(ddps, state) -> dict[str, torch.Tensor]:
    """Every reduced gradient (main_grad, unsharded) this rank holds at its full shape."""
    out = {}
    for ddp in ddps:
        for name, param in ddp.module.named_parameters():
            if not param.requires_grad:
                continue
            name = getattr(param, "checkpoint_name", name)
            group = state.expert_tp_group if is_expert_parallel(param) else state.tp_group
            out[name] = full_from_local(param.main_grad.clone(), tp_sharding_of(param), group)
    return out


def _aligned(value: torch.Tensor, ref: torch.Tensor):
    if value.shape != ref.shape:  # the padded vocabulary differs between layouts
        return value[:VOCAB].float(), ref[:VOCAB].float()
    return value.float(), ref.float()


def compare_params(got: dict, expected: dict) -> dict[str, float]:
    """Relative error ||got - expected|| / ||expected|| of each parameter."""
    from tests.distributed import rel_err

    return {name: rel_err(*_aligned(value, expected[name])) for name, value in got.items()}


def step_errors(outputs, reference) -> dict[str, float]:
    """The largest relative difference of the steps' losses and gradient norms from the
    reference run's (StepResults of the same steps)."""
    return {
        "loss_err": max(
            abs(o.loss - r.loss) / r.loss for o, r in zip(outputs, reference, strict=True)
        ),
        "norm_err": max(
            abs(o.grad_norm - r.grad_norm) / r.grad_norm
            for o, r in zip(outputs, reference, strict=True)
        ),
    }


def model_error(got: dict, expected: dict, initial: dict) -> dict[str, float]:
    """Over the parameters in `got` (a stage's, or all): the relative error of the parameter
    vector, the worst single tensor, and how far training moved the reference (so a match
    cannot come from nothing having changed)."""
    from tests.distributed import rel_err

    pairs = [_aligned(value, expected[name]) for name, value in sorted(got.items())]
    start = [_aligned(value, initial[name])[1] for name, value in sorted(got.items())]
    a = torch.cat([p[0].reshape(-1) for p in pairs])
    b = torch.cat([p[1].reshape(-1) for p in pairs])
    b0 = torch.cat([s.reshape(-1) for s in start])
    return {
        "model": rel_err(a, b),
        "worst_tensor": max(compare_params(got, expected).values()),
        "moved": rel_err(b, b0),
    }


def engine_steps(rank: int, world: int, extra: list[str], steps: int = 3):
    """`steps` training iterations of the engine set up from a tiny model's flags plus `extra`
    on `world` ranks (each data-parallel rank its own fixed random micro-batch). Returns
    the parameters by name before and after, the losses, and the main grads' dtype."""
    from engine.pretrain import parse
    from engine.train.iteration import train_iteration
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "64", "--lr", "1e-2", "--weight-decay", "0.1",
        "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--num-workers", "0",
    ]  # fmt: skip
    cfg = prepare(parse(argv + extra), world)
    par = cfg.parallel
    state = ParallelState.build(
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        ep=par.expert_model_parallel_size,
        etp=par.expert_tp_size,
    )
    engine = setup(cfg, state)
    ddp = engine.chunks[0]
    model = ddp.module

    def params():
        with ddp.gathered_parameters():
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    before = params()
    generator = torch.Generator().manual_seed(state.dp_rank)
    tokens = torch.randint(0, 64, (2, 17), generator=generator)
    losses = []
    for _ in range(steps):
        record = train_iteration(engine, [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}])
        losses.append(record.lm_loss)
    return before, params(), losses, ddp.params[0].main_grad.dtype
