"""A DeepSeek-V3-style model (multi-latent attention, a dense layer then mixtures of experts
behind the sigmoid router with its expert bias and a shared expert, one multi-token-prediction
depth) trained under DP2 with each of Megatron-LM's sharding strategies gives one process's
losses, gradient norms and weights; and resumes bit for bit under PP2 x DP2 with a pipeline
layout, the distributed optimizer and EP2."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _config():
    from tests.harness import tiny_config

    return tiny_config(
        "llama", group_query_attention=False, num_query_groups=None, multi_latent_attention=True,
        q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
        qk_layernorm=True, num_experts=4, moe_layer_freq="([0]*1+[1]*3)", moe_router_topk=2,
        moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        mtp_num_layers=1,
    )  # fmt: skip


def _run(rank, world, strategy):
    from parallel.state import ParallelState
    from tests.harness import engine_run, full_params, opt_config

    state = ParallelState.build()
    outputs, ddps, _ = engine_run(
        state, _config(), opt_config(), 3, 4, 4 // (2 * state.dp_size), sharding=strategy
    )
    return [(o.loss, o.grad_norm, o.mtp_losses) for o in outputs], full_params(ddps, state)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp2_with_each_sharding_strategy_matches_one_process(strategy):
    from tests.harness import compare_params

    ((reference, ref_params),) = run_ranks(_run, 1, "no_shard")
    for steps, params in run_ranks(_run, 2, strategy):
        for (loss, norm, mtp), (ref_loss, ref_norm, ref_mtp) in zip(steps, reference, strict=True):
            assert abs(loss - ref_loss) / ref_loss < 1e-5
            assert abs(norm - ref_norm) / ref_norm < 1e-4
            assert abs(mtp[0] - ref_mtp[0]) / ref_mtp[0] < 1e-5
        assert max(compare_params(params, ref_params).values()) < 1e-4, strategy


FLAGS = {
    "--multi-latent-attention": True, "--q-lora-rank": "24", "--kv-lora-rank": "16",
    "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "12",
    "--qk-layernorm": True, "--position-embedding-type": "rope", "--num-experts": "4",
    "--moe-layer-freq": "([0]*1+[1]*3)", "--moe-ffn-hidden-size": "24",
    "--moe-shared-expert-intermediate-size": "24", "--moe-router-score-function": "sigmoid",
    "--moe-router-enable-expert-bias": True, "--moe-router-topk": "2", "--swiglu": True,
    "--disable-bias-linear": True, "--normalization": "RMSNorm",
    "--untie-embeddings-and-output-weights": True, "--attention-dropout": "0.0",
    "--hidden-dropout": "0.0", "--mtp-num-layers": "1", "--pipeline-model-parallel-size": "2",
    "--pipeline-model-parallel-layout": "Ett|ttmL", "--expert-model-parallel-size": "2",
    "--use-distributed-optimizer": True, "--train-iters": "6", "--lr-warmup-iters": "1",
}  # fmt: skip


def test_resume_is_bit_exact(dataset_prefix, tokenizer_model, tmp_path):
    from tests.test_training import base_args, latest, losses, pretrain, records

    def args(**extra):
        return base_args(dataset_prefix, tokenizer_model, **FLAGS, **extra)

    pretrain(4, args(**{"--log-jsonl": str(tmp_path / "straight.jsonl")}))
    ckpt = str(tmp_path / "ckpt")
    a = {"--log-jsonl": str(tmp_path / "a.jsonl"), "--save": ckpt, "--save-interval": "3"}
    pretrain(4, args(**a, **{"--exit-interval": "3"}))
    assert latest(ckpt) == "3"
    pretrain(4, args(**{"--log-jsonl": str(tmp_path / "b.jsonl"), "--load": ckpt}))
    straight = losses(tmp_path / "straight.jsonl")
    resumed = losses(tmp_path / "a.jsonl") | losses(tmp_path / "b.jsonl")
    assert sorted(straight) == list(range(1, 7)) == sorted(resumed)
    assert resumed == straight  # bit for bit
    mtp = [[r.get("mtp_1_loss") for r in records(tmp_path / f) if "split" not in r]
           for f in ("straight.jsonl", "b.jsonl")]  # fmt: skip
    assert mtp[1] == mtp[0][3:] and all(mtp[0])
