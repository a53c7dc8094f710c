"""The machine a plan is made for: per-device compute and memory rates, the links between
devices, and the device memory. From a datasheet row (GPUs; rates at assumed efficiencies until
calibrated) or from a calibration file that `tools/plan.py --calibrate` measured.

Rates are what the engine's work achieves, not peaks: `gemm_flops` for its matrix products
(by the smallest of a product's three sizes, interpolated in log size between measured
points), `attention_flops` for core attention forward + backward in model FLOPs (the scores
and weighted sum counted in full, as engine/monitor/metrics.py counts them), `memory_bytes_per_s`
for its memory-bound ops. A link is latency + bytes / bandwidth per message step.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field, replace

from engine.errors import ConfigError


@dataclass(frozen=True)
class Link:
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Machine:
    name: str
    memory_bytes: float
    gemm_rates: tuple[tuple[float, float], ...]  # (smallest size, achieved FLOP/s), ascending
    attention_flops: float
    memory_bytes_per_s: float
    intra: Link  # between devices of one node
    inter: Link  # between nodes, per device
    gpus_per_node: int
    peak_flops: float | None = None  # datasheet dense peak, for MFU
    activation_bytes: int = 2  # 2 for bf16 / fp16 runs, 4 for fp32 (the CPU default)
    # Whether communication the engine starts asynchronously runs beside compute: on GPUs the
    # collectives have their own streams; a CPU rank's one core runs gloo's work too
    overlaps_comm: bool = True
    # Fixed costs measured with tiny models (seconds): "step", "per_microbatch" and
    # "per_microbatch_layer" (all three, or none)
    overheads: dict = field(default_factory=dict)

    def gemm_seconds(self, m: float, n: float, k: float) -> float:
        """A product of [m, k] by [k, n] (2 m n k FLOPs)."""
        return 2 * m * n * k / self.gemm_rate(min(m, n, k))

    def gemm_rate(self, size: float) -> float:
        sizes = [s for s, _ in self.gemm_rates]
        rates = [r for _, r in self.gemm_rates]
        if len(sizes) == 1:
            return rates[0]
        if size <= sizes[0]:
            return rates[0] * size / sizes[0]  # below the smallest measured: proportional
        if size >= sizes[-1]:
            return rates[-1]
        i = bisect.bisect_right(sizes, size)
        w = (math.log(size) - math.log(sizes[i - 1])) / (
            math.log(sizes[i]) - math.log(sizes[i - 1])
        )
        return rates[i - 1] + w * (rates[i] - rates[i - 1])

    def link(self, span: int) -> Link:
        """The link a group whose ranks lie within `span` consecutive ranks uses."""
        return self.intra if span <= self.gpus_per_node else self.inter

    def with_gemm_efficiency(self, efficiency: float) -> Machine:
        """The GEMM rate at `efficiency` of the peak, attention's rate scaled with it."""
        if self.peak_flops is None:
            raise ConfigError(f"{self.name}: no datasheet peak to take an efficiency of")
        old = self.gemm_rate(math.inf)
        rate = self.peak_flops * efficiency
        attention = self.attention_flops * rate / old
        return replace(self, gemm_rates=((1.0, rate),), attention_flops=attention)

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)


def load_machine(path: str, flag: str = "--calibration") -> Machine:
    """A Machine from a calibration file; a ConfigError naming the flag and the fix for a file
    that cannot be read or is not one --calibrate writes."""
    try:
        with open(path) as f:
            raw = json.load(f)
        raw["intra"], raw["inter"] = Link(**raw["intra"]), Link(**raw["inter"])
        raw["gemm_rates"] = tuple(sorted((float(s), float(r)) for s, r in raw["gemm_rates"]))
        machine = Machine(**raw)
        rates = [r for _, r in machine.gemm_rates] + [
            machine.attention_flops, machine.memory_bytes_per_s, machine.memory_bytes,
            machine.intra.bytes_per_s, machine.inter.bytes_per_s, machine.gpus_per_node,
        ]  # fmt: skip
        overheads = set(machine.overheads)
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot be read ({err.strerror})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{flag} {path}: not a calibration file ({type(err).__name__}: {err}); write one "
            "with tools/plan.py --calibrate"
        ) from None
    if not machine.gemm_rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ConfigError(
            f"{flag} {path}: a rate, size or count is not a positive number; calibrate again"
        )
    if overheads and overheads != {"step", "per_microbatch", "per_microbatch_layer"}:
        raise ConfigError(f"{flag} {path}: overheads must name step, per_microbatch and "
                          "per_microbatch_layer; calibrate again")  # fmt: skip
    return machine


# Datasheet rows: dense bf16 peak FLOP/s, memory, HBM bandwidth, NVLink bandwidth per
# direction, and the network per GPU (one 400 Gb/s NDR NIC per H100/H200, one 200 Gb/s HDR NIC
# per A100, as in NVIDIA's DGX systems). Latencies are typical NCCL step latencies.
DATASHEETS = {
    "h100": dict(peak=989e12, memory=80e9, hbm=3.35e12, nvlink=450e9, network=50e9),
    "h200": dict(peak=989e12, memory=141e9, hbm=4.8e12, nvlink=450e9, network=50e9),
    "a100": dict(peak=312e12, memory=80e9, hbm=2.0e12, nvlink=300e9, network=25e9),
}
# Shares of the datasheet rates assumed until calibrated (tools/plan.py --calibrate on the
# machine, or --gemm-efficiency from a measured run). Attention's share is of model FLOPs,
# which count the causal scores in full: a flash kernel that skips the masked half at 3/4 of
# the GEMMs' efficiency reaches 1.5x their model-FLOP rate.
ASSUMED = dict(gemm=0.6, attention=0.9, memory=0.8, link=0.8)


def datasheet_machine(name: str, gpus_per_node: int = 8, gemm_efficiency: float | None = None):
    key = name.lower()
    if key not in DATASHEETS:
        raise ConfigError(f"--gpu {name}: not a known GPU; one of {', '.join(DATASHEETS)}")
    row = DATASHEETS[key]
    gemm = ASSUMED["gemm"] if gemm_efficiency is None else gemm_efficiency
    return Machine(
        name=key.upper(),
        memory_bytes=row["memory"],
        gemm_rates=((1.0, row["peak"] * gemm),),
        attention_flops=row["peak"] * ASSUMED["attention"] * gemm / ASSUMED["gemm"],
        memory_bytes_per_s=row["hbm"] * ASSUMED["memory"],
        intra=Link(10e-6, row["nvlink"] * ASSUMED["link"]),
        inter=Link(20e-6, row["network"] * ASSUMED["link"]),
        gpus_per_node=gpus_per_node,
        peak_flops=row["peak"],
    )
