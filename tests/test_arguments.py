"""Megatron-LM flag names generate the configs; bad flags are one-line errors."""

from __future__ import annotations

import subprocess
import sys

from engine.config.arguments import parse_configs
from engine.config.model import ModelConfig

GROUPS = [(ModelConfig, "model")]


def test_megatron_flag_names_fill_model_config():
    configs = parse_configs(
        [
            "--num-layers",
            "4",
            "--hidden-size",
            "256",
            "--num-attention-heads",
            "8",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
            "--qk-layernorm",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
            "--rotary-base",
            "500000",
            "--hidden-dropout",
            "0.0",
            "--num-layers",
            "6",
        ],
        GROUPS,
    )
    cfg = configs[ModelConfig]
    assert cfg.num_layers == 6  # a later flag overrides an earlier one
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups) == (256, 8, 2)
    assert cfg.position_embedding_type == "rope" and cfg.normalization == "RMSNorm"
    assert cfg.swiglu and not cfg.add_bias_linear and cfg.untie_embeddings_and_output_weights
    assert cfg.qk_layernorm and cfg.rotary_base == 500000 and cfg.hidden_dropout == 0.0
    assert cfg.recompute_granularity == "full" and cfg.recompute_num_layers == 1
    assert cfg.ffn_size == 640  # swiglu default: 2/3 of 4h rounded down to 64
    defaults = parse_configs([], GROUPS)[ModelConfig]
    assert defaults == ModelConfig()
    # As in Megatron-LM, --num-query-groups is read only with --group-query-attention, and
    # that flag alone means one group.
    alone = parse_configs(["--num-attention-heads", "8", "--num-query-groups", "2"], GROUPS)
    assert alone[ModelConfig].query_groups == 8
    mqa = parse_configs(["--num-attention-heads", "8", "--group-query-attention"], GROUPS)
    assert mqa[ModelConfig].query_groups == 1


def test_unknown_flag_is_one_line_exit_2():
    code = (
        "from engine.config.arguments import parse_configs; "
        "from engine.config.model import ModelConfig; "
        "parse_configs(['--hiden-size', '3'], [(ModelConfig, 'model')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unrecognized arguments: --hiden-size 3; see --help"
    ]
