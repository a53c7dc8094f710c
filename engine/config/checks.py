"""The checks of a resolved configuration that read nothing but the configs and the world
size: the Megatron-LM flags this engine refuses, the layout (sizes against the world and the
model, context parallelism, pipeline stages and schedule, the batch split), the extra
measurements, the optimizer's schedule against the run's length, and each config's own
fields. They only read; engine/config/resolve.py wrote everything derived before them, and
engine/train/preflight.py adds the checks that read files, tokenizers and devices.
"""

from __future__ import annotations

from engine.config.configs import Configs
from engine.config.megatron.compat import check_megatron_flags
from engine.errors import ConfigError
from parallel.expert_parallel.groups import expert_layout_groups
from parallel.pipeline.layout import stage_layers
from parallel.pipeline.tables import (
    PLACEMENT,
    SPLIT_BACKWARD,
    V_SHAPED,
    min_microbatches,
    schedule_name,
)
from parallel.state import check_layout, check_optimizer_instances


def check_configs(cfg: Configs, world_size: int) -> int:
    """ConfigError (one line) on the first problem; returns the data-parallel size."""
    m, par = cfg.model, cfg.parallel
    check_megatron_flags(cfg.megatron, m.position_embedding_type, par.use_megatron_fsdp)
    dp = check_layout_flags(cfg, world_size)
    _check_noise_scale(cfg.logging, par, dp)
    _check_profile_steps(cfg.profiling)
    weight_check = cfg.exit.check_weight_hash_across_dp_replicas_interval
    if weight_check and par.sharding_strategy() == "optim_grads_params":
        raise ConfigError(
            "--check-weight-hash-across-dp-replicas-interval with sharded parameters "
            "(--use-megatron-fsdp's optim_grads_params): there are no replicas to compare "
            "(Megatron-LM refuses the pair too); drop one, or pick another sharding strategy"
        )
    training = cfg.training
    _check_eval_batches(cfg, dp)
    _check_data_skips(cfg)
    _check_dataset_gradients(cfg)
    cfg.optimizer.validate(training.train_iters, training.train_samples, training.global_batch(dp))
    cfg.data.validate()
    return dp


def _check_dataset_gradients(cfg: Configs) -> None:
    """--log-gradient-cosine-interval and --pcgrad split the loss by dataset: a mixture of
    experts' and multi-token prediction's added losses are not split (yet)."""
    flags = [name for name, on in (
        ("--log-gradient-cosine-interval", cfg.logging.log_gradient_cosine_interval),
        ("--pcgrad", cfg.optimizer.pcgrad),
    ) if on]  # fmt: skip
    if not flags:
        return
    if cfg.optimizer.pcgrad and cfg.resilience.reruns_non_finite:
        raise ConfigError(
            "--pcgrad with --rerun-on-nan: a rerun recomputes the step's gradient but not the "
            "datasets' it is built from; drop one of them"
        )
    for what, present in (
        ("a mixture of experts (its auxiliary losses)", cfg.model.is_moe),
        ("multi-token prediction (its depths' losses)", cfg.model.mtp_depths),
    ):
        if present:
            raise ConfigError(
                f"{flags[0]}: not with {what} yet: that loss is not split by dataset; drop "
                f"{flags[0]} or train without it"
            )


def _check_data_skips(cfg: Configs) -> None:
    """--rollback-on-spike reloads from --save; --skip-data-iterations lies within the run."""
    exits, iterations = cfg.exit, cfg.training.train_iters
    if exits.rollback_on_spike and not cfg.checkpointing.save:
        raise ConfigError(
            "--rollback-on-spike reloads an earlier checkpoint of --save, and there is none; "
            "add --save (with a --save-interval below --rollback-iterations)"
        )
    for first, last in exits.data_skips():
        if iterations is not None and last > iterations:
            raise ConfigError(
                f"--skip-data-iterations {first}:{last}: beyond the run's {iterations} "
                "iterations (--train-iters); give a range within them"
            )


def _check_eval_batches(cfg: Configs, dp: int) -> None:
    """--eval-global-batch-size and --eval-micro-batch-size: whole micro-batches on every
    data-parallel rank, and a pipeline schedule that runs them."""
    evaluation, training, par = cfg.evaluation, cfg.training, cfg.parallel
    if evaluation.eval_global_batch_size is None and evaluation.eval_micro_batch_size is None:
        return
    final = training.batch_schedule(dp, cfg.model.seq_length).final
    batch, micro = evaluation.batch_sizes(final, training.micro_batch_size)
    if batch % (micro * dp):
        raise ConfigError(
            f"--eval-global-batch-size {batch} must be a multiple of --eval-micro-batch-size "
            f"{micro} x data-parallel size {dp}"
        )
    pp, virtual = par.pipeline_model_parallel_size, par.virtual_size(cfg.model.num_layers)
    if pp > 1:
        from parallel.pipeline.schedules import checked_table

        name = schedule_name(par.pipeline_schedule, virtual)
        group = par.microbatch_group_size_per_virtual_pipeline_stage
        interleaving = virtual > 1 and par.pipeline_schedule not in V_SHAPED
        checked_table(name, pp, virtual, batch // (micro * dp), group if interleaving else None)


def check_layout_flags(cfg: Configs, world_size: int) -> int:
    """The checks of a resolved layout that need no data or files (sizes against the world,
    context parallelism, pipeline stages and schedule, the batch split against the run's
    length; the model's shape and the batch flags were checked by resolve); returns the
    data-parallel size. tools/plan.py validates the layouts it shows with this."""
    m, par = cfg.model, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = check_layout(world_size, tp, pp, cp=par.context_parallel_size)
    check_optimizer_instances(
        par.num_distributed_optimizer_instances, dp * par.context_parallel_size
    )
    _check_context_parallel(m, par)  # (the model's own shape: checked by resolve)
    _check_expert_parallel(m, par, dp)
    par.validate(m.num_layers)
    sections = (cfg.runtime, cfg.logging, cfg.evaluation, cfg.checkpointing, cfg.exit, cfg.fim)
    for section in (*sections, cfg.resilience):
        section.validate()
    cfg.runtime.validate_fp8(
        m.num_layers, par.pipeline_model_parallel_size, par.sharding_strategy()
    )
    cfg.optimizer.validate_muon(cfg.optimizer.optimizer, fp16=cfg.runtime.fp16)
    if cfg.resilience.reruns_non_finite and cfg.runtime.fp16:
        raise ConfigError(
            "--rerun-on-nan with --fp16: the loss scaler already handles non-finite gradients "
            "(overflows); leave one of them out"
        )
    if cfg.resilience.reruns_non_finite and m.moe_router_enable_expert_bias:
        raise ConfigError(
            "--rerun-on-nan does not restore the routers' expert bias, which moves every step "
            "(--moe-router-enable-expert-bias): leave one of them out"
        )
    _check_pipeline(cfg, dp)
    return dp


def _check_profile_steps(profiling) -> None:
    if profiling.profile and not 0 <= profiling.profile_step_start < profiling.profile_step_end:
        raise ConfigError(
            f"--profile-step-start {profiling.profile_step_start} must be below "
            f"--profile-step-end {profiling.profile_step_end} (and not negative)"
        )


def _check_noise_scale(logging, par, dp: int) -> None:
    """The noise scale needs each DP rank's whole own gradient of a step: two or more DP
    ranks, no CP (a CP rank's gradient covers part of each sequence), and gradients reduced
    once per step (not sharded every micro-batch)."""
    if not logging.log_gradient_noise_scale:
        return
    flag = "--log-gradient-noise-scale"
    if dp < 2:
        raise ConfigError(
            f"{flag} compares each data-parallel rank's gradient with their "
            "mean: it needs a data-parallel size of 2 or more"
        )
    if par.context_parallel_size > 1:
        raise ConfigError(f"{flag} is not available with --context-parallel-size above 1")
    if par.experts_apart:  # an expert's gradient on a rank holds other DP ranks' tokens too
        raise ConfigError(f"{flag} is not available with --expert-model-parallel-size above 1")
    if par.sharding_strategy() in ("optim_grads", "optim_grads_params"):
        raise ConfigError(
            f"{flag} is not available with --data-parallel-sharding-strategy "
            f"{par.sharding_strategy()} (gradients are reduced every micro-batch); use optim"
        )


def _check_expert_parallel(m, par, dp: int) -> None:
    """Expert parallelism needs experts it divides and a layout it folds into (Megatron-LM's
    checks); what is not built is refused."""
    ep, etp = par.expert_model_parallel_size, par.expert_tp_size
    tp = par.tensor_model_parallel_size
    if ep < 1 or etp < 1:
        raise ConfigError(
            "--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1"
        )
    if m.is_moe and tp > 1 and not par.sequence_parallel:
        raise ConfigError(
            f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
            "(as Megatron-LM: each tensor-parallel rank routes its part of the sequence)"
        )
    if not m.is_moe:
        if par.experts_apart:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp} need "
                "a mixture of experts: add --num-experts N, or drop them"
            )
        return
    given = "" if par.expert_tensor_parallel_size else " (the default: the TP size)"
    if etp > 1 and m.add_bias_linear:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp}{given} with biases: an expert split over "
            "ranks takes no biases here; add --disable-bias-linear, or give "
            "--expert-tensor-parallel-size 1"
        )
    if m.expert_ffn_size % etp:
        raise ConfigError(
            f"the experts' hidden size {m.expert_ffn_size} (--moe-ffn-hidden-size) is not "
            f"divisible by --expert-tensor-parallel-size {etp}{given}"
        )
    if m.num_experts % ep:
        raise ConfigError(
            f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size "
            f"{ep}; each expert-parallel rank holds the same number of experts"
        )
    pp, cp = par.pipeline_model_parallel_size, par.context_parallel_size
    expert_layout_groups(tp, cp, dp, pp, ep, etp, par.use_tp_pp_dp_mapping)  # folds, or refused
    if par.experts_apart and par.num_distributed_optimizer_instances > 1:
        raise ConfigError(
            "--num-distributed-optimizer-instances with --expert-model-parallel-size (or "
            "tensor parallelism) and --num-experts: not "
            "built yet (issue 40); use one instance"
        )


def _check_context_parallel(m, par) -> None:
    """The sequence splits into 2 x CP chunks (and each CP rank's part over TP under SP);
    the comm types fit the layers and the heads."""
    cp, tp, types = par.context_parallel_size, par.tensor_model_parallel_size, par.cp_comm_type
    if len(types) not in (1, m.num_layers):
        raise ConfigError(
            f"--cp-comm-type: {len(types)} values for {m.num_layers} layers; give one value, or "
            "one per layer"
        )
    if "a2a+p2p" in types:
        raise ConfigError(
            "--cp-comm-type a2a+p2p: hierarchical context parallelism is not available in this "
            "engine; use p2p, a2a or allgather"
        )
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        raise ConfigError(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp} "
            f"(each CP rank holds two chunks of every sequence); use a multiple of {2 * cp}"
        )
    if par.sequence_parallel and (m.seq_length // cp) % tp:
        raise ConfigError(
            f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
            f"--tensor-model-parallel-size {tp} (--sequence-parallel splits each CP rank's part)"
        )
    if m.multi_latent_attention and set(types) - {"p2p"}:
        other = sorted(set(types) - {"p2p"})[0]
        raise ConfigError(
            f"--cp-comm-type {other} with --multi-latent-attention: as megatron-core, "
            "multi-latent attention under context parallelism exchanges keys and values "
            "around the ring only; give --cp-comm-type p2p"
        )
    if m.attention_dropout > 0 and set(types) - {"a2a"}:
        raise ConfigError(
            f"--attention-dropout {m.attention_dropout}: dropout inside context-parallel "
            "attention is available with --cp-comm-type a2a only; pass --attention-dropout 0.0 "
            "(as Megatron-LM's Llama examples do) or --cp-comm-type a2a"
        )
    if "a2a" in types:
        for flag, count in (
            ("--num-attention-heads", m.num_attention_heads),
            ("key/value groups (--num-query-groups)", m.query_groups),
        ):
            if (count // tp) % cp:
                raise ConfigError(
                    f"--cp-comm-type a2a: {flag} {count} / --tensor-model-parallel-size {tp} "
                    f"is not divisible by --context-parallel-size {cp}; use p2p or allgather"
                )


def _check_pipeline(cfg, dp: int) -> None:
    m, par, train = cfg.model, cfg.parallel, cfg.training
    pp = par.pipeline_model_parallel_size
    virtual = par.virtual_size(m.num_layers)
    counts = par.stage_counts(m.num_layers, m.mtp_depths)  # a layout parses and adds up
    for rank in range(pp):
        stage_layers(
            m.num_layers,
            pp,
            rank,
            virtual,
            par.decoder_first_pipeline_num_layers,
            par.decoder_last_pipeline_num_layers,
            PLACEMENT.get(par.pipeline_schedule, "loop"),
            counts,
        )
    if par.pipeline_schedule in SPLIT_BACKWARD and not par.gradient_accumulation_fusion:
        raise ConfigError(
            f"--pipeline-schedule {par.pipeline_schedule} defers the weight-gradient GEMMs that "
            "add into the fp32 gradient buffer, which --no-gradient-accumulation-fusion turns "
            "off (every W would be empty): drop that flag or use 1f1b"
        )
    schedule = train.batch_schedule(dp, m.seq_length)
    batches, _ = schedule.sizes(train.train_iters)
    for batch in sorted(batches | {schedule.final}):
        microbatches = train.num_microbatches(dp, batch)
        fewest = min_microbatches(par.pipeline_schedule, pp)
        if microbatches < fewest:
            rule = "2 x pipeline-model-parallel-size" + (" - 1" if fewest % 2 else "")
            raise ConfigError(
                f"--pipeline-schedule {par.pipeline_schedule} needs at least {rule} = {fewest} "
                f"micro-batches per step ({microbatches} = global batch {batch} / "
                f"(micro-batch-size x data-parallel size {dp}))"
            )
        group = par.microbatch_group_size_per_virtual_pipeline_stage
        interleaving = virtual > 1 and par.pipeline_schedule not in V_SHAPED
        if interleaving and group is None and microbatches % pp:
            raise ConfigError(
                f"interleaved pipelining needs the micro-batches per step ({microbatches} = "
                f"global batch {batch} / (micro-batch-size x data-parallel size {dp})) to be a "
                f"multiple of pipeline-model-parallel-size {pp}"
            )
        if pp > 1:  # every rank's list and transfers, under gloo's and NCCL's rules
            from parallel.pipeline.schedules import checked_table

            name = schedule_name(par.pipeline_schedule, virtual)
            checked_table(name, pp, virtual, microbatches, group if interleaving else None)
