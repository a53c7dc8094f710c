"""Compute budgets: parameters N, training tokens D and training FLOPs C = 6 N D (the forward
and backward of a dense decoder, without attention's own term), compute-optimal splits of a
budget, and the time a cluster takes for it.

Compute-optimal, two ways (Hoffmann et al. 2022, "Training Compute-Optimal Large Language
Models"):
- about 20 tokens per parameter, the ratio of the paper's Table 3 (its approach 1), so
  N = sqrt(C / 120) and D = 20 N;
- the fitted loss L(N, D) = E + A / N^alpha + B / D^beta of its approach 3 (equation 10:
  E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28), minimised under C = 6 N D:
  N = G (C / 6)^(beta / (alpha + beta)), D = (C / 6)^(alpha / (alpha + beta)) / G with
  G = (alpha A / (beta B))^(1 / (alpha + beta)).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.errors import ConfigError

TOKENS_PER_PARAMETER = 20.0


@dataclass(frozen=True)
class FittedLaw:
    E: float = 1.69
    A: float = 406.4
    B: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28

    def loss(self, parameters: float, tokens: float) -> float:
        return self.E + self.A / parameters**self.alpha + self.B / tokens**self.beta

    def optimal(self, flops: float) -> tuple[float, float]:
        """(N, D) of the least loss for `flops` = 6 N D."""
        total = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / total)
        parameters = g * (flops / 6) ** (self.beta / total)
        return parameters, flops / (6 * parameters)


CHINCHILLA = FittedLaw()

# Published runs: (model, parameters, training tokens), from their papers
PUBLISHED_RUNS = (
    ("GPT-3 175B", 175e9, 300e9),
    ("Gopher 280B", 280e9, 300e9),
    ("Chinchilla 70B", 70e9, 1.4e12),
    ("LLaMA 7B", 6.7e9, 1.0e12),
    ("LLaMA 65B", 65.2e9, 1.4e12),
    ("Llama 2 7B", 6.7e9, 2.0e12),
    ("Llama 2 70B", 70e9, 2.0e12),
    ("Llama 3 8B", 8.0e9, 15e12),
    ("Llama 3 70B", 70.6e9, 15e12),
)


def training_flops(parameters: float, tokens: float) -> float:
    return 6.0 * parameters * tokens


def optimal_by_ratio(flops: float, ratio: float = TOKENS_PER_PARAMETER) -> tuple[float, float]:
    """(N, D) with D = ratio x N and 6 N D = flops."""
    parameters = math.sqrt(flops / (6.0 * ratio))
    return parameters, ratio * parameters


_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_amount(flag: str, text: str) -> float:
    """`7B`, `1.4T`, `5.76e23`, `300M` -> a number; ConfigError naming the flag otherwise."""
    found = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)\s*", text, re.IGNORECASE
    )
    if not found:
        raise ConfigError(f"{flag} {text!r}: not a number; write e.g. 7B, 1.4T or 5.76e23")
    value = float(found.group(1)) * _SUFFIX[found.group(2).upper()]
    if not 0 < value < math.inf:
        raise ConfigError(f"{flag} {text}: must be a finite number more than 0")
    return value


@dataclass(frozen=True)
class Cluster:
    gpus: int
    peak_tflops: float  # dense, per GPU, in the training dtype
    mfu: float  # the share of the peak the run reaches

    def flops_per_second(self) -> float:
        return self.gpus * self.peak_tflops * 1e12 * self.mfu

    def seconds(self, flops: float) -> float:
        return flops / self.flops_per_second()


def solve(parameters=None, tokens=None, flops=None, cluster=None, days=None) -> dict:
    """The budget from any two of N, D, C and (cluster and days); C alone gives its
    compute-optimal split by the 20-tokens rule. ConfigError when the givens contradict, or
    when what they give is beyond floating point (an infinite C, a zero N)."""
    try:
        out = _solve(parameters, tokens, flops, cluster, days)
    except (ZeroDivisionError, OverflowError):
        out = None
    scalars = ("parameters", "tokens", "flops", "tokens_per_parameter", "loss_fitted", "days")
    broken = (
        list(scalars)
        if out is None
        else [k for k in scalars if k in out and not (math.isfinite(out[k]) and out[k] > 0)]
    )
    if broken:
        what = "cannot be computed" if out is None else f"give {broken[0]} {out[broken[0]]:g}"
        raise ConfigError(
            f"--parameters/--tokens/--flops: these amounts {what}; give amounts of real runs "
            "(parameters and tokens between 1e3 and 1e20)"
        )
    return out


def _solve(parameters, tokens, flops, cluster, days) -> dict:
    if days is not None:
        if cluster is None:
            raise ConfigError("--days needs the cluster: --gpus and --gpu (and --mfu)")
        from_time = cluster.flops_per_second() * days * 86400
        if flops is not None and not math.isclose(flops, from_time, rel_tol=1e-9):
            raise ConfigError("--flops and --days both fix the compute; give one")
        flops = from_time
    given = sum(x is not None for x in (parameters, tokens, flops))
    if given > 2:
        raise ConfigError(
            "--parameters, --tokens and --flops (or --days) over-determine it; give two"
        )
    if given == 0:
        raise ConfigError("give two of --parameters, --tokens, --flops (or --days with a cluster)")
    if given == 1:
        if flops is not None:
            parameters, tokens = optimal_by_ratio(flops)
        elif parameters is not None:
            tokens = TOKENS_PER_PARAMETER * parameters
        else:
            parameters = tokens / TOKENS_PER_PARAMETER
    if flops is None:
        flops = training_flops(parameters, tokens)
    elif parameters is None:
        parameters = flops / (6.0 * tokens)
    elif tokens is None:
        tokens = flops / (6.0 * parameters)
    out = {
        "parameters": parameters,
        "tokens": tokens,
        "flops": flops,
        "tokens_per_parameter": tokens / parameters,
        "optimal_20x": optimal_by_ratio(flops),
        "optimal_fitted": CHINCHILLA.optimal(flops),
        "loss_fitted": CHINCHILLA.loss(parameters, tokens),
    }
    out["loss_fitted_optimal"] = CHINCHILLA.loss(*out["optimal_fitted"])
    if cluster is not None:
        seconds = cluster.seconds(flops)
        out["days"] = seconds / 86400
        out["gpu_hours"] = seconds / 3600 * cluster.gpus
    return out
