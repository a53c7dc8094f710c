"""Parameter groups and the optimizer.

No weight decay on biases and norm weights (every 1-D parameter). The optimizer is torch's
AdamW (fused on CUDA, foreach elsewhere), apex's FusedAdam when asked for and importable, SGD,
or Muon with AdamW (engine/optim/muon_with_adam.py),
wrapped by parallel.data_parallel.optimizer.DistributedOptimizer, which feeds it fp32 masters
(sharded over DP with --use-distributed-optimizer).
"""

from __future__ import annotations

import torch

from engine.config.optimizer import OptimizerConfig
from engine.errors import ConfigError
from parallel.data_parallel.grad_scaler import DynamicGradScaler
from parallel.data_parallel.optimizer import DistributedOptimizer


def no_weight_decay(param: torch.nn.Parameter) -> bool:
    return param.ndim == 1


def decoupled(param: torch.nn.Parameter) -> bool:
    """Trained at --decoupled-lr when given: the word embeddings and the output layer."""
    return getattr(param, "is_embedding_or_output_parameter", False)


def _make_inner(cfg: OptimizerConfig, device: torch.device):
    if cfg.optimizer == "muon":  # Adam's options for the rest; Muon's in its group
        from engine.optim.muon_with_adam import MuonWithAdam

        impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
        return lambda groups: MuonWithAdam(
            groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **impl
        )
    if cfg.optimizer == "sgd":
        return lambda groups: torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    if cfg.apex_fused_adam:
        try:
            from apex.optimizers import FusedAdam
        except ImportError:
            raise ConfigError(
                "--apex-fused-adam: apex is not importable; install NVIDIA apex from source "
                "(not `pip install apex`, an unrelated package) or drop the flag"
            ) from None
        return lambda groups: FusedAdam(
            groups,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            adam_w_mode=True,
        )
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return lambda groups: torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **impl
    )


def build_optimizer(
    ddps,
    cfg: OptimizerConfig,
    *,
    use_distributed_optimizer: bool,
    fp16: bool,
    tp_rank: int,
    model_parallel_group,
    instance_group,
    device: torch.device,
    dp_group=None,
    experts_apart: bool = False,
    expert_norm_group=None,
    tp_group=None,
    expert_tp_group=None,
) -> DistributedOptimizer:
    """The training optimizer over the DDP-wrapped model chunks. `instance_group`: the ranks
    of one distributed-optimizer instance (the world unless
    --num-distributed-optimizer-instances), over which a sharded optimizer's norms are summed.
    `experts_apart`: expert parallelism, the experts' norm summed over `expert_norm_group`
    without sharding (parallel/data_parallel/optimizer.py). `tp_group` (`expert_tp_group` for
    the routed experts): Muon's gathers and sums under --muon-tp-mode duplicated and
    distributed."""
    scaler = None
    if fp16:
        scaler = DynamicGradScaler(
            initial_scale=cfg.initial_loss_scale,
            min_scale=cfg.min_loss_scale,
            growth_interval=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
        )
    # with and without weight decay, then the same two at --decoupled-lr (empty groups dropped)
    groups = [{"weight_decay": cfg.weight_decay, "decays": True}, {"weight_decay": 0.0}]
    groups = [dict(g, name=cfg.optimizer if cfg.optimizer == "sgd" else "adam") for g in groups]
    groups += [dict(g, decoupled=True) for g in groups]
    split = cfg.decoupled_lr is not None

    def group_of(p) -> int:
        return int(no_weight_decay(p)) + 2 * int(split and decoupled(p))

    muon_group = len(groups)  # (engine/monitor/grad_norm_parts.py labels it by this index)
    if cfg.optimizer == "muon":  # a fifth group: Muon's
        from engine.optim.muon_with_adam import takes_muon

        groups.append(_muon_group(cfg))
        adam_group_of = group_of

        def group_of(p) -> int:
            return muon_group if takes_muon(p) else adam_group_of(p)

    optimizer = DistributedOptimizer(
        ddps,
        _make_inner(cfg, device),
        groups,
        group_of,
        shard=use_distributed_optimizer,
        clip_grad=cfg.clip_grad,
        grad_scaler=scaler,
        tp_rank=tp_rank,
        model_parallel_group=model_parallel_group,
        instance_group=instance_group,
        dp_group=dp_group,
        experts_apart=experts_apart,
        expert_norm_group=expert_norm_group,
    )
    if cfg.optimizer == "muon":
        groups = (tp_group, expert_tp_group if expert_tp_group is not None else tp_group)
        _give_muon_its_matrices(optimizer, cfg, group_of, muon_group, groups)
    return optimizer


def _give_muon_its_matrices(optimizer, cfg: OptimizerConfig, group_of, muon_group, tp_groups):
    """How Muon sees each of its parameters (engine/optim/muon_with_adam.py; a routed expert's
    over the expert TP group, the second of `tp_groups`), and with sharding, which DP rank
    orthogonalises which (engine/optim/muon_sharded.py)."""
    from engine.optim.muon_with_adam import muon_matrix
    from parallel.expert_parallel.params import is_expert_parallel

    def matrix_of(param):
        group = tp_groups[int(is_expert_parallel(param))]
        return muon_matrix(param, group, cfg.muon_tp_mode, cfg.muon_split_qkv)

    if not optimizer.shard:
        optimizer.optimizer.matrices = {
            piece.master: matrix_of(piece.param)
            for piece in optimizer.pieces
            if piece.group == muon_group
        }
        return
    from engine.optim.muon_sharded import plan_sharded_muon

    optimizer.optimizer.sharded = plan_sharded_muon(
        optimizer.ddps, optimizer.pieces, lambda p: group_of(p) == muon_group, matrix_of,
        dict(_muon_group(cfg), lr=cfg.lr), optimizer.device,
    )  # fmt: skip


def _muon_group(cfg: OptimizerConfig) -> dict:
    """Muon's group options (engine/optim/muon.py's names) from the --muon-* flags."""
    return {
        "muon": True, "name": "muon", "weight_decay": cfg.weight_decay, "decays": True,
        "momentum": cfg.muon_momentum, "nesterov": cfg.muon_use_nesterov,
        "ns_steps": cfg.muon_num_ns_steps, "coefficients": cfg.muon_coefficient_type,
        "precision": cfg.muon_fp32_matmul_prec, "scale_mode": cfg.muon_scale_mode,
        "extra_scale_factor": cfg.muon_extra_scale_factor,
    }  # fmt: skip
