"""The MoE layer against megatron-core 0.16.1's own (MoELayer with its local experts, run on the
CPU on one gloo rank): on the same weights and tokens, the router's probabilities and routing
map, the load-balancing and z losses, the layer's output, the input's and every weight's
gradient (which carry the losses' gradients) and the expert bias after a step's update, for the
router settings Mixtral, Qwen-MoE, DeepSeek-V3 and Switch-style models use.

Two shims let megatron-core's layer run without CUDA: torch.cuda.current_device answers the CPU
(its router puts buffers and weights there), and moe_utils.te_general_gemm, a name its router's
gate reads that is left undefined without Transformer Engine, is None (its own fallback then
runs: a plain matmul)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from engine.config.model import ModelConfig
from engine.model.context import BuildContext
from engine.model.moe.layer import MoELayer
from tests.distributed import run_ranks
from tests.requirements import require
from tools.megatron_cpu import router_without_transformer_engine

H, F_EXPERT, SEQ, BATCH = 16, 24, 6, 3

CASES = {
    "mixtral: softmax over the top 2, aux_loss, SwiGLU": dict(
        num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=[0.01], swiglu=True
    ),
    "qwen2-moe: pre-softmax, seq_aux_loss, z-loss, GELU, gated shared expert": dict(
        num_experts=4,
        moe_router_topk=2,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type=["seq_aux_loss"],
        moe_aux_loss_coeff=[0.02],
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True,
    ),
    "deepseek-v3: sigmoid, expert bias, group-limited, scaled": dict(
        num_experts=8,
        moe_router_topk=4,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type=["seq_aux_loss"],
        moe_aux_loss_coeff=[1e-3],
        swiglu=True,
        moe_shared_expert_intermediate_size=16,
    ),
    "switch: top-1, capacity 1.0 by probability, padded, fp64 router": dict(
        num_experts=4,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        moe_aux_loss_coeff=[0.01],
        moe_router_dtype="fp64",
        swiglu=True,
    ),
    "capacity 1.5 by position, global_aux_loss and aux_loss": dict(
        num_experts=4,
        moe_router_topk=2,
        moe_expert_capacity_factor=1.5,
        moe_token_drop_policy="position",
        moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.01, 0.02],
        swiglu=True,
    ),
    "input jitter 0.1 (the same draws from the same seed)": dict(
        num_experts=4, moe_router_topk=2, moe_input_jitter_eps=0.1, swiglu=True
    ),
    "sinkhorn top-1": dict(
        num_experts=4, moe_router_topk=1, moe_router_load_balancing_type=["sinkhorn"], swiglu=True
    ),
    "top-1 with the probability on the input": dict(
        num_experts=4,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_apply_probs_on_input=True,
        swiglu=True,
    ),
}


def _megatron_config(ours: ModelConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kinds = ours.moe_router_load_balancing_type
    coeffs = ours.moe_aux_loss_coeff
    return TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=ours.num_experts,
        moe_ffn_hidden_size=F_EXPERT,
        moe_router_topk=ours.moe_router_topk,
        moe_router_score_function=ours.moe_router_score_function,
        moe_router_pre_softmax=ours.moe_router_pre_softmax,
        moe_router_load_balancing_type=kinds[0] if len(kinds) == 1 else list(kinds),
        moe_aux_loss_coeff=coeffs[0] if len(coeffs) == 1 else list(coeffs),
        moe_z_loss_coeff=ours.moe_z_loss_coeff,
        moe_router_enable_expert_bias=ours.moe_router_enable_expert_bias,
        moe_router_num_groups=ours.moe_router_num_groups,
        moe_router_group_topk=ours.moe_router_group_topk,
        moe_router_topk_scaling_factor=ours.moe_router_topk_scaling_factor,
        moe_router_dtype=ours.moe_router_dtype,
        moe_expert_capacity_factor=ours.moe_expert_capacity_factor,
        moe_token_drop_policy=ours.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=ours.moe_pad_expert_input_to_capacity,
        moe_apply_probs_on_input=ours.moe_apply_probs_on_input,
        moe_input_jitter_eps=ours.moe_input_jitter_eps,
        moe_shared_expert_intermediate_size=ours.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=ours.moe_shared_expert_gate,
        gated_linear_unit=ours.swiglu,
        activation_func=F.silu if ours.swiglu else F.gelu,
        add_bias_linear=ours.add_bias_linear,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="allgather",
    )


def _copy_weights(ours: MoELayer, theirs) -> None:
    with torch.no_grad():
        theirs.router.weight.copy_(ours.router.weight)
        if ours.router.bias is not None:
            theirs.router.bias.copy_(ours.router.bias)
        pairs = list(zip(ours.experts.local_experts, theirs.experts.local_experts, strict=True))
        if ours.shared_experts is not None:
            pairs.append((ours.shared_experts, theirs.shared_experts))
            if ours.shared_experts.gate_weight is not None:
                theirs.shared_experts.gate_weight.copy_(ours.shared_experts.gate_weight)
        for mine, other in pairs:
            for name in ("linear_fc1", "linear_fc2"):
                getattr(other, name).weight.copy_(getattr(mine, name).weight)
                if getattr(mine, name).bias is not None:
                    getattr(other, name).bias.copy_(getattr(mine, name).bias)


def _compare(rank, world):
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: torch.device("cpu")
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer as TheirLayer

    router_without_transformer_engine()
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    results = {}
    for name, options in CASES.items():
        cfg = ModelConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=2,
            seq_length=SEQ,
            moe_ffn_hidden_size=F_EXPERT,
            **{"add_bias_linear": False, "bias_gelu_fusion": False, **options},
        )
        cfg.validate()
        ours = MoELayer(BuildContext(cfg, seed=7), 0).train()
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False)
        theirs = TheirLayer(
            _megatron_config(cfg), spec.submodules.mlp.submodules, layer_number=1
        ).train()
        theirs.set_layer_number(1)  # (its transformer layer does this; its losses are logged)
        _copy_weights(ours, theirs)
        if cfg.moe_router_enable_expert_bias:  # a bias that changes the choice
            bias = torch.linspace(-0.3, 0.3, cfg.num_experts)
            ours.router.expert_bias.data.copy_(bias)
            theirs.router.expert_bias.copy_(bias)
        moe_utils.clear_aux_losses_tracker()
        x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(3))
        upstream = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(4))
        found = {}
        for who, layer in (("ours", ours), ("theirs", theirs)):
            inputs = x.clone().requires_grad_()
            torch.manual_seed(11)  # (the jitter's draws)
            with torch.no_grad():  # (no losses, no token counts)
                probs, routing_map = layer.router(inputs.detach())
            torch.manual_seed(11)
            out = layer(inputs)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(upstream)
            found[who] = {
                "probs": probs.detach(),
                "map": routing_map,
                "out": out.detach(),
                "x_grad": inputs.grad,
                "grads": [p.grad for p in _weights(layer)],
            }
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        theirs_losses = {k: v["values"][0].clone() for k, v in tracker.items() if v["values"][0]}
        ours_losses = dict(ours.router.recorded)
        bias = None
        if cfg.moe_router_enable_expert_bias:
            ours.router.end_step(None, None)
            counts = theirs.router.local_tokens_per_expert.clone()
            their_bias = moe_utils.get_updated_expert_bias(
                counts, theirs.router.expert_bias, cfg.moe_router_bias_update_rate
            )
            bias = (ours.router.expert_bias.clone(), their_bias)
        results[name] = (found, ours_losses, theirs_losses, bias)
    parallel_state.destroy_model_parallel()
    return results


def _weights(layer):
    params = [layer.router.weight]
    experts = list(layer.experts.local_experts)
    if layer.shared_experts is not None:
        experts.append(layer.shared_experts)
        if getattr(layer.shared_experts, "gate_weight", None) is not None:
            params.append(layer.shared_experts.gate_weight)
    for expert in experts:
        params += [expert.linear_fc1.weight, expert.linear_fc2.weight]
    return params


def test_moe_layer_equals_megatron_cores():
    require("megatron.core")
    (results,) = run_ranks(_compare, 1)
    for name, (found, ours_losses, theirs_losses, bias) in results.items():
        ours, theirs = found["ours"], found["theirs"]
        assert torch.equal(ours["map"], theirs["map"]), name
        torch.testing.assert_close(ours["probs"], theirs["probs"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["out"], theirs["out"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["x_grad"], theirs["x_grad"], rtol=1e-5, atol=1e-6)
        assert len(ours["grads"]) == len(theirs["grads"]), name
        for mine, other in zip(ours["grads"], theirs["grads"], strict=True):
            torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-7)
        assert sorted(ours_losses) == sorted(theirs_losses), (name, ours_losses, theirs_losses)
        for key, value in ours_losses.items():
            torch.testing.assert_close(value, theirs_losses[key], rtol=1e-5, atol=1e-8)
        if bias is not None:
            torch.testing.assert_close(bias[0], bias[1])
            assert not torch.equal(bias[0], torch.linspace(-0.3, 0.3, 8)), name  # it moved
