"""How the model and the data are split over processes (`ParallelConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError
from parallel.pipeline.tables import V_SHAPED


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and the data are split over processes."""

    tensor_model_parallel_size: int = option(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = option(1, "pipeline-parallel size (PP)")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "layers per virtual stage: interleaved 1F1B with num_layers / (PP x this) chunks"
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
        if not self.num_layers_per_virtual_pipeline_stage:
            return 1
        per_stage = num_layers // self.pipeline_model_parallel_size
        return per_stage // self.num_layers_per_virtual_pipeline_stage

    def validate(self, num_layers: int) -> None:
        pp = self.pipeline_model_parallel_size
        layers_per_virtual = self.num_layers_per_virtual_pipeline_stage
        if layers_per_virtual:
            if pp < 2:
                raise ConfigError(
                    "--num-layers-per-virtual-pipeline-stage needs "
                    "--pipeline-model-parallel-size of 2 or more"
                )
            if num_layers % (pp * layers_per_virtual):
                raise ConfigError(
                    f"num-layers {num_layers} is not divisible by pipeline-model-parallel-size "
                    f"{pp} x num-layers-per-virtual-pipeline-stage {layers_per_virtual}"
                )
            if self.virtual_size(num_layers) < 2:
                raise ConfigError(
                    f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual} leaves one "
                    f"chunk per stage; use fewer layers per virtual stage or drop the flag"
                )
        if self.pipeline_schedule == "interleaved" and not layers_per_virtual:
            raise ConfigError(
                "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage"
            )
        if self.pipeline_schedule in ("gpipe", "1f1b", "zb-h1") and layers_per_virtual:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} cannot run virtual stages; "
                "drop --num-layers-per-virtual-pipeline-stage"
            )
        if self.pipeline_schedule in V_SHAPED and self.virtual_size(num_layers) != 2:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} runs 2 model chunks per rank: set "
                "--num-layers-per-virtual-pipeline-stage to num-layers / (2 x "
                "pipeline-model-parallel-size)"
            )
        if self.overlap_p2p_communication and not layers_per_virtual:
            raise ConfigError(
                "--overlap-p2p-communication runs with the interleaved schedule only; add "
                "--num-layers-per-virtual-pipeline-stage or drop the flag"
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
