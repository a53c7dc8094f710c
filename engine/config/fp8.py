"""The FP8 part of the runtime config (`Fp8Options`, which `RuntimeConfig` extends): Megatron-LM's
flags, meanings and defaults (megatron-core 0.16.1), and their checks. The recipes themselves:
engine/ops/fp8/recipe.py; which layers: engine/ops/fp8/apply.py."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class Fp8Options:
    """FP8 training."""

    fp8: str | None = option(
        None,
        "FP8 GEMMs in the transformer layers' linears: e4m3 for every tensor, or hybrid (E4M3 "
        "forward, E5M2 output gradients)",
        flag="--fp8-format",
        choices=["e4m3", "hybrid"],
    )
    fp8_recipe: str = option(
        "delayed",
        "delayed (per-tensor scales from earlier steps' amaxes), tensorwise (per-tensor current "
        "scales), blockwise (1x128 activation and gradient tiles, 128x128 weight blocks), "
        "mxfp8 (1x32 blocks, E8M0 scales)",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
    )
    fp8_margin: int = option(0, "delayed scaling: scale = fp8_max / amax / 2^margin")
    fp8_interval: int = option(1, "ignored, as in megatron-core since Transformer Engine 1.8")
    fp8_amax_history_len: int = option(1, "delayed scaling: steps of amax history kept")
    fp8_amax_compute_algo: str = option(
        "most_recent",
        "delayed scaling: the amax a scale comes from, the newest or the largest of the history",
        choices=["most_recent", "max"],
    )
    fp8_wgrad: bool = option(
        True,
        "--no-fp8-wgrad: the weight-gradient GEMM in the activations' precision",
        flag="--no-fp8-wgrad",
        action="store_false",
        aliases=("--disable-fp8-wgrad",),
    )
    fp8_param_gather: bool = option(
        False,
        "all-gather the FP8 layers' weights in FP8 after the distributed optimizer's step "
        "(the model computes with those FP8 values)",
    )
    fp8_backend: str = option(
        "native",
        "whose FP8 GEMMs: the engine's own (native), or torchao's float8 training where it is "
        "installed (delayed and tensorwise recipes)",
        choices=["native", "torchao", "transformer_engine"],
    )
    first_last_layers_bf16: bool = option(
        False, "with --fp8-format: the first and last transformer layers stay in bf16"
    )
    num_layers_at_start_in_bf16: int = option(
        1, "with --first-last-layers-bf16: this many of the first layers"
    )
    num_layers_at_end_in_bf16: int = option(
        1, "with --first-last-layers-bf16: this many of the last layers"
    )

    def fp8_kept_layers(self) -> tuple[int, int]:
        """(layers at the start, at the end) kept out of FP8."""
        if not self.first_last_layers_bf16:
            return (0, 0)
        return (self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16)

    def validate_fp8(self, num_layers: int, pp: int, sharding: str) -> None:
        """ConfigError naming the flag for what FP8 training cannot take."""
        if self.fp8 is None:
            if self.fp8_param_gather:
                raise ConfigError("--fp8-param-gather needs --fp8-format (as megatron-core)")
            if self.fp8_backend != "native":
                raise ConfigError(f"--fp8-backend {self.fp8_backend} needs --fp8-format")
            return
        if self.fp8_recipe == "custom":
            raise ConfigError(
                "--fp8-recipe custom takes a Transformer Engine quantizer factory, which this "
                "engine does not load (nothing it loads runs code); pick delayed, tensorwise, "
                "blockwise or mxfp8"
            )
        if self.fp8_param_gather:
            self._validate_param_gather(sharding)
        if self.fp8_backend == "torchao":
            check_torchao(self.fp8_recipe)
        if self.fp8_backend == "transformer_engine":
            raise ConfigError(
                "--fp8-backend transformer_engine: Transformer Engine's FP8 layers are not "
                "wired in; use --fp8-backend native or torchao"
            )
        if self.fp8_amax_history_len < 1:
            raise ConfigError(
                f"--fp8-amax-history-len {self.fp8_amax_history_len} must be at least 1"
            )
        if self.first_last_layers_bf16 and self.fp8_recipe == "delayed":
            raise ConfigError(
                "--first-last-layers-bf16 with --fp8-recipe delayed: as megatron-core, delayed "
                "scaling keeps every layer in FP8; pick tensorwise, blockwise or mxfp8"
            )
        for flag, count in (("start", self.num_layers_at_start_in_bf16),
                            ("end", self.num_layers_at_end_in_bf16)):  # fmt: skip
            if self.first_last_layers_bf16 and not 0 <= count <= num_layers // pp:
                raise ConfigError(
                    f"--num-layers-at-{flag}-in-bf16 {count} must lie in 0..{num_layers // pp} "
                    "(--num-layers / --pipeline-model-parallel-size, as megatron-core)"
                )
        if self.torch_compile:
            raise ConfigError(
                "--fp8-format with --torch-compile: the FP8 layers' collectives and amax "
                "records are not tested inside compiled graphs yet; drop one"
            )

    def _validate_param_gather(self, sharding: str) -> None:
        if sharding == "no_shard":
            raise ConfigError(
                "--fp8-param-gather needs --use-distributed-optimizer (as megatron-core): "
                "without it no parameters are gathered"
            )
        if self.fp8_recipe == "mxfp8":
            raise ConfigError(
                "--fp8-param-gather with --fp8-recipe mxfp8 is not built: the backward "
                "quantises W^T in 1 x 32 blocks along the other dimension, which the gathered "
                "row-wise FP8 values cannot give; pick delayed, tensorwise or blockwise, or drop "
                "the flag"
            )


def check_torchao(recipe: str) -> None:
    """ConfigError naming the flag when --fp8-backend torchao cannot run this recipe here
    (engine/ops/fp8/torchao_linear.py)."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "--fp8-backend torchao: torchao is not installed; pip install torchao==0.15.0 "
            "(or drop the flag for the engine's own FP8 GEMMs)"
        )
    if recipe not in ("delayed", "tensorwise"):
        raise ConfigError(
            f"--fp8-backend torchao with --fp8-recipe {recipe}: torchao's float8 training "
            "scales per tensor here; pick delayed or tensorwise, or --fp8-backend native"
        )
