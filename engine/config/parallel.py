"""How the model and the data are split over processes (`ParallelConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError
from parallel.pipeline.layout_string import parse_layout, split_counts, unrolled
from parallel.pipeline.tables import V_SHAPED


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and the data are split over processes."""

    tensor_model_parallel_size: int = option(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = option(1, "pipeline-parallel size (PP)")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "layers per virtual stage: interleaved 1F1B with num_layers / (PP x this) chunks"
    )
    num_virtual_stages_per_pipeline_rank: int | None = option(
        None, "model chunks per pipeline rank (interleaved 1F1B), the layers split evenly"
    )
    pipeline_model_parallel_layout: str | None = option(
        None,
        "the layers of every pipeline stage, as a string: E (embedding), t (transformer "
        "layer), m (MTP layer), L (loss), | between stages (PP x virtual stages, rank-major "
        "per virtual stage), X*N and (...)*N to repeat, e.g. 'Et*3|(tt|)*6,mL'",
    )
    account_for_embedding_in_pipeline_split: bool = option(
        False, "the embedding takes a layer's place in the first pipeline stage's split"
    )
    account_for_loss_in_pipeline_split: bool = option(
        False, "the loss takes a layer's place in the last pipeline stage's split"
    )
    decoder_first_pipeline_num_layers: int | None = option(
        None, "layers on the first pipeline stage (the rest split evenly)"
    )
    decoder_last_pipeline_num_layers: int | None = option(
        None, "layers on the last pipeline stage (the rest split evenly)"
    )
    microbatch_group_size_per_virtual_pipeline_stage: int | None = option(
        None,
        "interleaved schedule: micro-batches run through each virtual stage in a row "
        "(default pipeline-model-parallel-size; at most the micro-batches per step)",
    )
    pipeline_schedule: str | None = option(
        None,
        "force a schedule (default: 1F1B, interleaved with virtual stages): gpipe, 1f1b, "
        "interleaved, zb-h1 (zero bubble, 1F1B's memory), zb-v (zero bubble, 2 chunks per "
        "rank in a V), dualpipe-v (DeepSeek's DualPipe in a V)",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"],
    )
    overlap_p2p_communication: bool = option(
        False,
        "interleaved schedule: pipeline transfers run during compute",
        switches={"--no-overlap-p2p-communication": False},
    )
    sequence_parallel: bool = option(False, "split norms/dropout/residuals along the sequence")
    context_parallel_size: int = option(
        1, "context-parallel size (CP): each sample's sequence is split over this many ranks"
    )
    cp_comm_type: list[str] = option(
        ["p2p"],
        "how CP attention exchanges keys and values: p2p (ring), a2a (all-to-all over heads), "
        "allgather (a2a+p2p is refused); one value, or one per layer",
        nargs="+",
        choices=["p2p", "a2a", "allgather", "a2a+p2p"],
    )
    gradient_accumulation_fusion: bool = option(
        True,
        "linear layers add their weight gradients straight into the fp32 main_grad buffer, "
        "with no .grad per micro-batch",
        flag="--no-gradient-accumulation-fusion",
        action="store_false",
    )
    use_distributed_optimizer: bool = option(False, "shard optimizer state over DP (ZeRO)")
    use_megatron_fsdp: bool = option(
        False,
        "fully sharded data parallelism with --data-parallel-sharding-strategy (implies "
        "--use-distributed-optimizer)",
    )
    data_parallel_sharding_strategy: str | None = option(
        None,
        "with --use-megatron-fsdp, what DP ranks shard (default optim_grads_params): "
        "optimizer state (optim), also gradients (optim_grads), also parameters; without "
        "it no effect (as in Megatron-LM)",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    num_distributed_optimizer_instances: int = option(
        1,
        "copies of the distributed optimizer across data parallelism: each shards over "
        "DP x CP / this many ranks, its shards all-reduced with the other copies' "
        "(hybrid sharding; needs --use-distributed-optimizer)",
    )
    expert_model_parallel_size: int = option(
        1,
        "expert-parallel size (EP): each MoE layer's experts spread over this many ranks, "
        "folded out of tensor x context x data parallel; tokens reach them by all-to-all",
    )
    expert_tensor_parallel_size: int | None = option(
        None,
        "ranks each expert is split over, as a tensor-parallel linear (default "
        "--tensor-model-parallel-size): they gather the rows routed to it and sum its outputs",
    )
    overlap_grad_reduce: bool = option(False, "reduce gradient buckets during backward")
    overlap_param_gather: bool = option(
        False, "with the distributed optimizer: gather parameters during the next forward"
    )
    ddp_bucket_size: int | None = option(None, "elements per gradient bucket")
    distributed_timeout_minutes: float = option(
        10.0, "a collective waiting longer than this fails the run (e.g. a dead rank)"
    )
    use_tp_pp_dp_mapping: bool = option(
        False,
        "number the ranks TP innermost, then CP, then PP, then DP (Megatron-LM's order "
        "tp-cp-ep-pp-dp) instead of ... DP, then PP: a pipeline's stages on neighbouring ranks",
    )

    @property
    def expert_tp_size(self) -> int:
        """--expert-tensor-parallel-size, by default the tensor-parallel size (Megatron-LM)."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def experts_apart(self) -> bool:
        """Whether the experts have process groups of their own (expert parallelism, or an
        expert tensor-parallel size other than the tensor-parallel size)."""
        return self.expert_model_parallel_size > 1 or self.expert_tp_size != (
            self.tensor_model_parallel_size
        )

    def sharding_strategy(self) -> str:
        """What DP ranks shard (parallel/data_parallel/ddp.py): Megatron-LM's strategy names."""
        if self.use_megatron_fsdp:
            return self.data_parallel_sharding_strategy or "optim_grads_params"
        return "optim" if self.use_distributed_optimizer else "no_shard"

    def shards_optimizer(self) -> bool:
        return self.sharding_strategy() != "no_shard"

    def virtual_size(self, num_layers: int) -> int:
        """Model chunks per pipeline rank."""
        pp = self.pipeline_model_parallel_size
        if self.pipeline_model_parallel_layout:
            return max(1, len(unrolled(self.pipeline_model_parallel_layout).split("|")) // pp)
        if self.num_virtual_stages_per_pipeline_rank:
            return self.num_virtual_stages_per_pipeline_rank
        if not self.num_layers_per_virtual_pipeline_stage:
            return 1
        split = self.account_for_embedding_in_pipeline_split
        split += self.account_for_loss_in_pipeline_split
        per_stage = (num_layers + split) // pp
        return per_stage // self.num_layers_per_virtual_pipeline_stage

    @property
    def virtual_stages_asked(self) -> bool:
        """Whether a flag asks for virtual pipeline stages (interleaving)."""
        return bool(
            self.num_layers_per_virtual_pipeline_stage
            or self.num_virtual_stages_per_pipeline_rank
            or self.pipeline_model_parallel_layout
        )

    def stage_counts(self, num_layers: int, mtp_layers: int = 0) -> tuple[int, ...] | None:
        """Decoder layers of each pipeline chunk in layout order where a flag places them
        (--pipeline-model-parallel-layout, --account-for-*-in-pipeline-split;
        parallel/pipeline/layout_string.py); None for the even split (or
        --decoder-first/last-pipeline-num-layers). ConfigError for a layout that does not
        parse or add up."""
        pp = self.pipeline_model_parallel_size
        if self.pipeline_model_parallel_layout:
            text = self.pipeline_model_parallel_layout
            return parse_layout(text, pp, num_layers, mtp_layers).counts
        embedding = self.account_for_embedding_in_pipeline_split
        loss = self.account_for_loss_in_pipeline_split
        if embedding or loss:
            return split_counts(num_layers, pp, self.virtual_size(num_layers), embedding, loss)
        return None

    def _virtual_flag(self) -> str:
        """The flag that asked for virtual stages."""
        if self.pipeline_model_parallel_layout:
            return "the virtual stages of --pipeline-model-parallel-layout"
        if self.num_virtual_stages_per_pipeline_rank:
            return "--num-virtual-stages-per-pipeline-rank"
        return "--num-layers-per-virtual-pipeline-stage"

    def _validate_placement(self) -> None:
        """One way of placing layers at a time, as Megatron-LM asks."""
        virtual = [
            flag
            for flag, given in (
                (
                    "--num-layers-per-virtual-pipeline-stage",
                    self.num_layers_per_virtual_pipeline_stage,
                ),
                (
                    "--num-virtual-stages-per-pipeline-rank",
                    self.num_virtual_stages_per_pipeline_rank,
                ),
                ("--pipeline-model-parallel-layout", self.pipeline_model_parallel_layout),
            )
            if given  # fmt: skip
        ]
        if len(virtual) > 1:
            raise ConfigError(f"{virtual[0]} and {virtual[1]}: give one of them (as Megatron-LM)")
        uneven = self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers
        accounts = (
            self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split
        )
        if self.pipeline_model_parallel_layout and (uneven or accounts):
            raise ConfigError(
                "--pipeline-model-parallel-layout places every layer: drop "
                "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split"
            )
        if uneven and accounts:
            raise ConfigError(
                "--account-for-*-in-pipeline-split with --decoder-first/last-pipeline-num-layers:"
                " give one of them (as Megatron-LM)"
            )
        vpp = self.num_virtual_stages_per_pipeline_rank
        if vpp is not None and (vpp < 1 or (vpp > 1 and self.pipeline_model_parallel_size < 2)):
            raise ConfigError(
                f"--num-virtual-stages-per-pipeline-rank {vpp} needs to be at least 1, and more "
                "than 1 only with --pipeline-model-parallel-size of 2 or more"
            )
        if self.pipeline_model_parallel_layout and self.pipeline_schedule in V_SHAPED:
            raise ConfigError(
                f"--pipeline-model-parallel-layout with --pipeline-schedule "
                f"{self.pipeline_schedule}: a layout's stages are in the interleaved order; "
                "the V placement of these schedules is not read from one here"
            )

    def validate(self, num_layers: int) -> None:
        pp = self.pipeline_model_parallel_size
        layers_per_virtual = self.num_layers_per_virtual_pipeline_stage
        self._validate_placement()
        if layers_per_virtual:
            if pp < 2:
                raise ConfigError(
                    "--num-layers-per-virtual-pipeline-stage needs "
                    "--pipeline-model-parallel-size of 2 or more"
                )
            extra = self.account_for_embedding_in_pipeline_split
            extra += self.account_for_loss_in_pipeline_split
            if (num_layers + extra) % (pp * layers_per_virtual):
                counted = f" (+ {extra} for the embedding/loss)" if extra else ""
                raise ConfigError(
                    f"num-layers {num_layers}{counted} is not divisible by "
                    f"pipeline-model-parallel-size {pp} x num-layers-per-virtual-pipeline-stage "
                    f"{layers_per_virtual}"
                )
            if self.virtual_size(num_layers) < 2:
                raise ConfigError(
                    f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual} leaves one "
                    f"chunk per stage; use fewer layers per virtual stage or drop the flag"
                )
        virtual = self.virtual_size(num_layers)
        if self.pipeline_schedule == "interleaved" and virtual < 2:
            raise ConfigError(
                "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage"
                " (or --num-virtual-stages-per-pipeline-rank, or a layout of virtual stages)"
            )
        if self.pipeline_schedule in ("gpipe", "1f1b", "zb-h1") and virtual > 1:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} cannot run virtual stages; "
                f"drop {self._virtual_flag()}"
            )
        if self.pipeline_schedule in V_SHAPED and self.virtual_size(num_layers) != 2:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} runs 2 model chunks per rank: set "
                "--num-layers-per-virtual-pipeline-stage to num-layers / (2 x "
                "pipeline-model-parallel-size)"
            )
        if self.overlap_p2p_communication and virtual < 2:
            raise ConfigError(
                "--overlap-p2p-communication runs with the interleaved schedule only; add "
                "--num-layers-per-virtual-pipeline-stage (or --num-virtual-stages-per-pipeline-"
                "rank, or a layout of virtual stages) or drop the flag"
            )
        if self.overlap_param_gather and not self.shards_optimizer():
            # with optim_grads_params the gathers always run ahead of the forward (prefetch)
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer (with "
                "--use-megatron-fsdp: a --data-parallel-sharding-strategy other than no_shard)"
            )
        instances = self.num_distributed_optimizer_instances
        if instances > 1 and not self.shards_optimizer():
            raise ConfigError(
                f"--num-distributed-optimizer-instances {instances} needs "
                "--use-distributed-optimizer (or --use-megatron-fsdp with a sharding strategy)"
            )
        if (
            self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers
        ) and pp < 2:
            raise ConfigError(
                "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size >= 2"
            )
        if self.distributed_timeout_minutes <= 0:
            raise ConfigError("--distributed-timeout-minutes must be positive")
