"""The Muon part of the optimizer config (`MuonOptions`, which `OptimizerConfig` extends):
megatron-core 0.16.1's --muon-* flags, meanings and defaults (--muon-coefficient-type from
later releases), and their checks. The update: engine/optim/muon.py; which parameters get it:
engine/optim/muon_with_adam.py."""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class MuonOptions:
    """Muon (--optimizer muon)."""

    muon_momentum: float = option(0.9, "Muon: momentum (a moving average of the gradients)")
    muon_split_qkv: bool = option(
        True,
        "--muon-no-split-qkv: orthogonalise a fused QKV weight as one matrix, not as its Q, K "
        "and V",
        flag="--muon-no-split-qkv",
        action="store_false",
    )
    muon_use_nesterov: bool = option(False, "Muon: Nesterov momentum", aliases=("--muon-nesterov",))
    muon_scale_mode: str = option(
        "spectral",
        "Muon: the update's scale by the matrix's shape: sqrt(max(rows, cols)) (spectral), "
        "sqrt(max(1, rows / cols)) (shape_scaling), sqrt(rows / cols) (unit_rms_norm)",
        choices=["spectral", "unit_rms_norm", "shape_scaling"],
    )
    muon_extra_scale_factor: float = option(
        1.0, "Muon: a further factor on the update (0.2 matches Adam's update RMS)"
    )
    muon_fp32_matmul_prec: str = option(
        "medium",
        "Muon: the Newton-Schulz iterations in bf16 (medium) or fp32 (high: TF32 on GPUs)",
        choices=["low", "medium", "high"],
    )
    muon_num_ns_steps: int = option(5, "Muon: Newton-Schulz iterations")
    muon_coefficient_type: str = option(
        "quintic",
        "Muon: the Newton-Schulz coefficients, megatron-core's five-step set (quintic) or one "
        "set for every step (simple)",
        choices=["quintic", "simple"],
    )
    muon_tp_mode: str = option(
        "blockwise",
        "Muon under tensor parallelism: each rank orthogonalises its own shard (blockwise), "
        "the whole matrix, gathered (duplicated), or its shard as part of the whole matrix, "
        "the Gram products summed over TP (distributed)",
        choices=["blockwise", "duplicated", "distributed"],
    )

    def validate_muon(self, optimizer: str, *, fp16: bool) -> None:
        """ConfigError naming the flag for what Muon cannot take (--optimizer dist_muon is
        Muon with the distributed optimizer: engine/config/resolve.py)."""
        if optimizer != "muon":
            given = [
                f"--{f.name.replace('_', '-')}"
                for f in fields(MuonOptions)
                if getattr(self, f.name) != f.default
            ]
            if given:
                flag = "--muon-no-split-qkv" if given[0] == "--muon-split-qkv" else given[0]
                raise ConfigError(
                    f"{flag} goes with --optimizer muon, not {optimizer}; drop it or train with "
                    "Muon"
                )
            return
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"--muon-momentum {self.muon_momentum} must lie in [0, 1)")
        if self.muon_num_ns_steps < 1:
            raise ConfigError(f"--muon-num-ns-steps {self.muon_num_ns_steps} must be at least 1")
        if self.muon_fp32_matmul_prec == "low":
            raise ConfigError(
                "--muon-fp32-matmul-prec low is not one of torch's matmul precisions; give "
                "medium (bf16 iterations) or high (fp32)"
            )
        if fp16:
            raise ConfigError("--optimizer muon with --fp16: as megatron-core, Muon takes bf16 "
                              "or fp32 (no loss scaler); use --bf16")  # fmt: skip
