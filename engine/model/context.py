"""What every layer of the model is built with, passed down explicitly (no globals)."""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.config.model import ModelConfig
from engine.model.attention_kernel import AttentionMasks
from engine.model.moe.aux_loss import AuxLossScale
from engine.model.norm import Norm
from engine.ops.torch_ops import TorchOps
from parallel.context_parallel.attention import rank_positions
from parallel.random import RNGStatesTracker
from parallel.tensor_parallel.init import normal_init, scaled_normal_init
from parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass
class BuildContext:
    """Model config plus the parallel facts a layer needs to build and run itself."""

    config: ModelConfig
    tp_group: object = None
    tp_size: int = 1
    sequence_parallel: bool = False
    cp_group: object = None  # context parallel: each sample's sequence split over these ranks
    cp_size: int = 1
    cp_rank: int = 0
    cp_comm_type: tuple[str, ...] = ("p2p",)  # one for every layer, or one per layer
    dp_cp_group: object = None  # DP x CP (MoE: global_aux_loss counts tokens over it)
    ep_group: object = None  # expert parallel: the ranks an MoE layer's experts are spread over
    ep_size: int = 1
    ep_rank: int = 0
    expert_tp_group: object = None  # expert tensor parallel: the ranks sharing each expert
    expert_tp_size: int = 1
    tp_communication: bool = True  # False: linears only multiply, their caller communicates
    gradient_accumulation_fusion: bool = True  # weight gradients straight into main_grad
    tracker: RNGStatesTracker | None = None
    params_dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    seed: int = 1234
    ops: object = field(default_factory=TorchOps)  # TorchOps or engine.ops.fused.FusedOps
    times: object = None  # parallel.timing.StepTimes: TP communication counted as "tp-comm"
    attention_masks: AttentionMasks = field(default_factory=AttentionMasks)  # shared by layers
    moe_loss_scale: AuxLossScale = field(default_factory=AuxLossScale)  # set by each step

    def param_seed(self, name: str) -> int:
        """Initialisation seed of the parameter with this global name: the same on every rank
        and for every layout, so TP and PP sizes never change the initial model."""
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)

    @property
    def init_method(self):
        return normal_init(self.config.init_method_std)

    @property
    def output_init_method(self):
        return scaled_normal_init(self.config.init_method_std, self.config.num_layers)

    def column_linear(
        self,
        name: str,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        partition_sizes: list[int] | None = None,
        partition_names: list[str] | None = None,
        initialized_rows: int | None = None,
    ) -> ColumnParallelLinear:
        """A column-parallel linear whose weight is the global parameter `name`.weight, drawn
        with the model's initialisation; `partition_sizes`/`partition_names`: the logical
        tensors a fused weight stacks (checkpoints store each)."""
        return ColumnParallelLinear(
            input_size,
            output_size,
            tp_group=self.tp_group,
            init_method=self.init_method,
            init_seed=self.param_seed(f"{name}.weight"),
            bias=bias,
            sequence_parallel=self.sequence_parallel,
            partition_sizes=partition_sizes,
            partition_names=partition_names,
            initialized_rows=initialized_rows,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            params_dtype=self.params_dtype,
            device=self.device,
            times=self.times,
            communicate=self.tp_communication,
        )

    def row_linear(
        self, name: str, input_size: int, output_size: int, *, bias: bool
    ) -> RowParallelLinear:
        """A row-parallel linear whose weight is the global parameter `name`.weight, drawn
        with the output initialisation (scaled by the depth, as Megatron-LM's projections back
        into the residual stream)."""
        return RowParallelLinear(
            input_size,
            output_size,
            tp_group=self.tp_group,
            init_method=self.output_init_method,
            init_seed=self.param_seed(f"{name}.weight"),
            bias=bias,
            sequence_parallel=self.sequence_parallel,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            params_dtype=self.params_dtype,
            device=self.device,
            times=self.times,
            communicate=self.tp_communication,
        )

    def norm(self, size: int | None = None) -> Norm:
        """The model's norm (--normalization, --norm-epsilon, --apply-layernorm-1p) over `size`
        channels (default the hidden size) of activations between TP blocks: under SP each TP
        rank sees part of the sequence, and its weights' gradients are summed over TP."""
        cfg = self.config
        return Norm(
            cfg.normalization,
            cfg.hidden_size if size is None else size,
            cfg.norm_epsilon,
            partial_grad=self.sequence_parallel,
            params_dtype=self.params_dtype,
            device=self.device,
            ops=self.ops,
            zero_centered=cfg.apply_layernorm_1p,
        )

    def vocab_embedding(self, name: str, *, scatter: bool = True) -> VocabParallelEmbedding:
        """The vocab-parallel word embedding, the global parameter `name`; `scatter`: its
        output is split along the sequence under sequence parallelism (False for the last
        stage's copy of a tied embedding, which only lends its weight to the output layer)."""
        cfg = self.config
        return VocabParallelEmbedding(
            cfg.padded_vocab_size(self.tp_size),
            cfg.hidden_size,
            tp_group=self.tp_group,
            init_method=self.init_method,
            init_seed=self.param_seed(name),
            vocab_size=cfg.vocab_size,
            sequence_parallel=self.sequence_parallel and scatter,
            params_dtype=self.params_dtype,
            device=self.device,
            times=self.times,
        )

    def cp_comm_type_of(self, layer_number: int) -> str:
        types = self.cp_comm_type
        return types[min(layer_number, len(types) - 1)]  # (MTP layers: the last layer's)

    def token_positions(self, local_length: int, device) -> torch.Tensor:
        """Global positions of the `local_length` tokens of a sample this rank holds (its two
        load-balanced chunks under context parallelism; before any sequence-parallel split)."""
        if self.cp_size == 1:
            return torch.arange(local_length, device=device)
        return rank_positions(local_length * self.cp_size, self.cp_size, self.cp_rank, device)

    def hidden_dropout(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """--hidden-dropout on [s, b, h] activations between TP blocks (in training), drawn
        from the per-rank stream when they are sequence-split, else from the default stream
        shared by the TP group."""
        p = self.config.hidden_dropout
        if not training or p == 0.0:
            return x
        split = self.sequence_parallel and self.tracker is not None
        with self.tracker.fork() if split else contextlib.nullcontext():
            return F.dropout(x, p, training=True)
