"""Training metrics: throughput, model FLOPs and MFU, memory, and where they are written.

Model FLOPs per token of a dense decoder (L layers, hidden h, n heads of which k key/value
groups, FFN size f, sequence s, padded vocabulary V; a multiply-add is 2 FLOPs):

    weights per layer  = 2*h*h (Q and O) + 2*h*h*k/n (K and V) + g*h*f (MLP; g = 3 for SwiGLU,
                         else 2)
    forward per token  = 2 * (L * weights per layer + h*V) + 4*L*s*h
                         (the last term: attention scores and the weighted sum, counted in full
                         for the causal mask, as Megatron-LM does)
    training per token = 3 * forward (recomputation is not model FLOPs)

Each multi-token-prediction depth adds a layer built as the last one, its projection (2h*h) and
a head (h*V). Multi-latent attention's weights are its five projections
(engine/config/latent_attention.py: latent_projections), and its 4*s*h becomes
2*s*n*(query/key + value width per head).
A mixture-of-experts layer's MLP term counts what a token computes: the router (h*E), its
top-k experts (k * g*h*f_expert; not the E experts a layer holds), the shared experts
(g*h*f_shared) and their gate (h).

MFU = achieved model FLOP/s per device / the device's dense peak for the training dtype
(datasheet numbers below; None where the device is unknown, e.g. a CPU).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time

import torch

from engine.config.model import ModelConfig

# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets, by (name fragment, dtype).
PEAK_TFLOPS = {
    ("H200", "bf16"): 989.0,
    ("H200", "fp16"): 989.0,
    ("H100 SXM", "bf16"): 989.0,
    ("H100 SXM", "fp16"): 989.0,
    ("H100 80GB HBM3", "bf16"): 989.0,
    ("H100 80GB HBM3", "fp16"): 989.0,
    ("H100 PCIe", "bf16"): 756.0,
    ("H100 PCIe", "fp16"): 756.0,
    ("H100", "bf16"): 989.0,
    ("H100", "fp16"): 989.0,
    ("A100", "bf16"): 312.0,
    ("A100", "fp16"): 312.0,
    ("A100", "fp32"): 19.5,
    ("L40S", "bf16"): 362.0,
}


def mlp_active(cfg: ModelConfig) -> int:
    """The weights a token multiplies by in a mixture-of-experts layer's MLP: the router, its
    top-k experts, the shared experts and their gate."""
    h, g = cfg.hidden_size, 3 if cfg.gated_linear_unit else 2
    shared = cfg.moe_shared_expert_intermediate_size or 0
    active = h * cfg.num_experts + cfg.moe_router_topk * g * h * cfg.expert_ffn_size
    return active + g * h * shared + (h if cfg.moe_shared_expert_gate else 0)


def model_flops_per_token(cfg: ModelConfig, padded_vocab: int) -> float:
    """Training FLOPs per token (see the module docstring for what is counted)."""
    h, n, k = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups
    d = cfg.head_dim
    attention = 2 * h * n * d + 2 * h * k * d  # Q, O and K, V (= 2h^2 + 2h^2 k/n when d = h/n)
    scores = 4 * cfg.seq_length * n * d
    if cfg.multi_latent_attention:  # its projections; query/key and value widths per head
        attention = sum(i * o for i, o, _ in cfg.latent_projections())
        scores = 2 * cfg.seq_length * n * (cfg.latent_query_head_dim + cfg.v_head_dim)
    g = 3 if cfg.gated_linear_unit else 2
    moe_layers = sum(cfg.moe_layer_pattern(cfg.num_layers))
    mlp = (cfg.num_layers - moe_layers) * g * h * cfg.ffn_size
    if moe_layers:
        mlp += moe_layers * mlp_active(cfg)
    forward = 2 * (cfg.num_layers * attention + mlp + h * padded_vocab)
    forward += cfg.num_layers * scores
    if cfg.mtp_depths:  # each depth: a layer as the last, its projection (2h -> h), a head
        last = 1 if cfg.moe_layer_pattern(cfg.num_layers)[-1] else 0
        layer_mlp = mlp_active(cfg) if last else g * h * cfg.ffn_size
        forward += cfg.mtp_depths * (2 * (attention + layer_mlp + 2 * h * h + h * padded_vocab))
        forward += cfg.mtp_depths * scores
    return 3.0 * forward


def device_peak_tflops(device: torch.device, dtype: str) -> tuple[float | None, str]:
    """(dense peak TFLOP/s, device name) for a CUDA device we know, else (None, name)."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for (fragment, kind), peak in PEAK_TFLOPS.items():
        if fragment in name and kind == dtype:
            return peak, name
    return None, name


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: allocated CUDA memory, or resident CPU memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def cuda_memory_tags(device: torch.device) -> dict[str, int]:
    """Megatron-LM's --log-memory-to-tensorboard scalars: the CUDA caching allocator's
    reserved, allocated and peak allocated bytes and its live allocations (none on a CPU,
    which has no such allocator)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "mem-reserved-bytes": stats["reserved_bytes.all.current"],
        "mem-allocated-bytes": stats["allocated_bytes.all.current"],
        "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
        "mem-allocated-count": stats["allocation.all.current"],
    }


class Throughput:
    """Time between log points and the derived rates."""

    def __init__(self, flops_per_token: float, world_size: int, peak_tflops: float | None):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak_tflops
        self.start = time.perf_counter()

    def reset(self) -> None:
        self.start = time.perf_counter()

    def rates(self, tokens: int, iterations: int = 1) -> dict:
        """Rates since the last reset, over `iterations` iterations."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tokens_per_sec = tokens / elapsed
        tflops = tokens_per_sec * self.flops_per_token / self.world_size / 1e12
        out = {
            "tokens_per_sec": tokens_per_sec,
            "tflops_per_device": tflops,
            "iteration_time_s": elapsed / max(iterations, 1),
        }
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out


# TensorBoard tags Megatron-LM writes for the same quantities, so that dashboards made for
# its runs read ours; each is also written against consumed samples (" vs samples"), as there.
# Keys without a Megatron-LM counterpart keep their JSONL names.
MEGATRON_TAGS = {
    "lm_loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "params_norm": "params-norm",
    "num_zeros": "num-zeros",
    "loss_scale": "loss-scale",
    "batch_size": "batch-size",
    "tflops_per_device": "throughput",
    "iteration_time_s": "iteration-time",
}
EVAL_TAG_NAMES = {"valid": "validation", "test": "test"}
# What Megatron-LM's training_log writes to TensorBoard every --tensorboard-log-interval
# iterations, each iteration's own value (`MetricsWriter.log_iteration`); a training record's
# other scalars (rates, times, a blend's losses) go with its log line, every --log-interval.
PER_ITERATION_KEYS = frozenset(
    ("lm_loss", "lr", "grad_norm", "params_norm", "num_zeros", "loss_scale", "batch_size")
)


def _per_iteration(key: str) -> bool:
    return key in PER_ITERATION_KEYS or key.startswith("mem-")


def tensorboard_scalars(record: dict, split: str | None = None) -> list[tuple[str, float, str]]:
    """(tag, value, x axis: 'iteration' or 'samples') for a training record, or for an
    evaluation record of `split`, under Megatron-LM's tags where it has them."""
    samples = "consumed_samples" in record
    out = []
    for key, value in record.items():
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or key in ("iteration", "consumed_samples") or not math.isfinite(value):
            continue
        # a blended dataset's loss, lm_loss/<name>, sits beside Megatron-LM's "lm loss" tag
        base, _, domain = key.partition("/")
        suffix = f"/{domain}" if base == "lm_loss" and domain else ""
        if split == "tasks":  # --eval-tasks' scores: tasks/acc/<task>, tasks/acc_norm/<task>
            out.append((f"tasks/{key}", value, "iteration"))
            continue
        if split is not None:
            name = EVAL_TAG_NAMES[split]
            tag = {"lm_loss": f"lm loss {name}", "ppl": f"lm loss {name} ppl"}.get(key)
            tag = f"lm loss {name}{suffix}" if suffix else tag
            if tag is None:
                continue
        else:
            tag = f"lm loss{suffix}" if suffix else MEGATRON_TAGS.get(key, key)
            if key.startswith("mtp_") and key.endswith("_loss"):  # Megatron-LM's mtp_<k> loss
                tag = f"{key.removesuffix('_loss')} loss"
            if base == "time" and domain:  # Megatron-LM's timer tags: <name>-time
                tag = f"{domain}-time"
        out.append((tag, value, "iteration"))
        if samples and (split is not None or key in MEGATRON_TAGS):
            out.append((f"{tag} vs samples", value, "samples"))
    return out


class MetricsWriter:
    """Console lines, a JSONL file (--log-jsonl), TensorBoard scalars (--tensorboard-dir) and
    a wandb run (`wandb`: a started engine.monitor.wandb.WandbWriter), written by the one rank
    that sees the loss (last pipeline stage, first TP and DP rank)."""

    def __init__(
        self,
        enabled: bool,
        jsonl: str | None,
        tensorboard_dir: str | None,
        wandb=None,
        tensorboard_queue_size: int = 1000,
    ):
        self.enabled = enabled
        self.jsonl = None
        self.tensorboard = None
        self.wandb = wandb
        if not enabled:
            return
        if jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
            self.jsonl = open(jsonl, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(tensorboard_dir, max_queue=tensorboard_queue_size)

    def log(self, record: dict, step: int, split: str | None = None) -> None:
        """One training record, or an evaluation record of `split` (valid, test)."""
        if not self.enabled:
            return
        if self.jsonl is not None:  # non-finite numbers are written as null (valid JSON)
            clean = {
                k: v if not isinstance(v, float) or math.isfinite(v) else None
                for k, v in record.items()
            }
            self.jsonl.write(json.dumps(clean) + "\n")
        if self.tensorboard is not None:
            kept = record
            if split is None:  # the per-iteration scalars were written by log_iteration
                kept = {k: v for k, v in record.items() if not _per_iteration(k)}
            self._tensorboard(kept, step, split)
        if self.wandb is not None:
            self.wandb.log(record, step, split)

    def log_iteration(self, record: dict, step: int) -> None:
        """One iteration's TensorBoard scalars (PER_ITERATION_KEYS and the mem- tags of
        `record`, which also carries iteration and consumed_samples)."""
        if self.enabled and self.tensorboard is not None:
            names = ("iteration", "consumed_samples")
            kept = {k: v for k, v in record.items() if k in names or _per_iteration(k)}
            self._tensorboard(kept, step, None)

    def _tensorboard(self, record: dict, step: int, split: str | None) -> None:
        for tag, value, axis in tensorboard_scalars(record, split):
            x = record["consumed_samples"] if axis == "samples" else step
            self.tensorboard.add_scalar(tag, value, x)

    def log_samples(self, record: dict, step: int) -> None:
        """Generation samples (engine/eval/samples.py): a JSONL record, TensorBoard text."""
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for k, sample in enumerate(record["samples"], start=1):
                text = (
                    f"**prompt**: `{sample['prompt']}`\n\n**greedy**: `{sample['greedy']}`"
                    f"\n\n**sampled**: `{sample['sampled']}`"
                )
                self.tensorboard.add_text(f"samples/{k}", text, step)
        if self.wandb is not None:
            self.wandb.log_samples(record, step)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


class SpikeDetector:
    """Flags a loss more than `zscore` standard deviations above the mean of the last
    `window` finite losses (needs at least 10 of them)."""

    def __init__(self, window: int, zscore: float):
        self.window, self.threshold = window, zscore
        self.history: list[float] = []

    def check(self, loss: float) -> float | None:
        """The z-score when `loss` is a spike, else None; non-spikes join the history."""
        if not math.isfinite(loss):
            return None
        recent = self.history[-self.window :]
        if len(recent) >= 10:
            mean = sum(recent) / len(recent)
            std = math.sqrt(sum((x - mean) ** 2 for x in recent) / len(recent))
            z = (loss - mean) / max(std, 1e-8)
            if z > self.threshold:
                return z
        self.history.append(loss)
        del self.history[: -self.window]
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(x) for x in state.get("history", [])]
