"""The log lines of a training run: the training window, the evaluations and the generation
samples of --eval-prompts. Each reads typed results (engine/train/iteration.py's
IterationResult) and writes a record under Megatron-LM's keys to the metrics writers."""

from __future__ import annotations

import math
import statistics

import torch

from engine.eval.samples import Decoding, decode
from engine.eval.tasks_in_training import score_tasks
from engine.model.moe.stats import LOSS_NAMES
from engine.monitor.metrics import cuda_memory_tags, memory_gb
from engine.monitor.moe_metrics import log_keys as moe_log_keys
from engine.train.iteration import IterationResult
from engine.train.loss import domain_losses
from engine.train.state import Run
from parallel.timing import measure


def log_window(run: Run, window: list[IterationResult], tokens: int) -> None:
    """The log line (and metrics record) of the iterations since the last one."""
    c = run.progress.counters
    updated = [r for r in window if r.updated]
    losses = [r.lm_loss for r in updated] or [r.lm_loss for r in window]
    loss = sum(losses) / len(losses)
    last = window[-1]
    run.progress.last_train_loss = loss if math.isfinite(loss) else None
    record = {
        "iteration": c.iteration,
        "consumed_samples": c.consumed_samples,
        "lm_loss": loss if math.isfinite(loss) else None,
        "lr": last.lr,
        "grad_norm": last.grad_norm,
        "loss_scale": last.loss_scale,
        "batch_size": last.batch_size,
        "skipped_iters": c.skipped_iters,
        "mem_gb": memory_gb(run.state.device),
    }
    # as Megatron-LM: the last iteration's value (the zeros of the last update taken)
    if last.params_norm is not None:
        record["params_norm"] = last.params_norm
    zeros = [r.num_zeros for r in window if r.num_zeros is not None]
    if zeros:
        record["num_zeros"] = zeros[-1]
    if run.cfg.logging.log_memory_to_tensorboard:
        record |= cuda_memory_tags(run.state.device)
    finite = [x for x in losses if math.isfinite(x)]
    if len(finite) > 1:  # how much the loss moved between the iterations of the window
        record["lm_loss_var"] = statistics.pvariance(finite)
    scales = [r for r in window if r.gradient_noise_scale is not None]
    if scales:  # the smoothed estimate after the window's last measured step, and that
        # step's own-gradient norm (the root of the DP ranks' mean |own gradient|^2)
        record["gradient_noise_scale"] = scales[-1].gradient_noise_scale
        record["local_grad_norm"] = scales[-1].local_grad_norm
    record |= _window_domain_losses(updated or window, run.features.domain_names)
    record |= _window_mtp_losses(updated or window)
    per_layer = run.cfg.logging.moe_per_layer_logging
    record |= moe_log_keys([r.moe for r in window if r.moe is not None], per_layer)
    record |= _mix_keys(run)
    found = [r.grad_cosines for r in window if r.grad_cosines is not None]
    if found:  # the window's last measurement (--log-gradient-cosine-interval)
        record |= found[-1]
    ratios = [r.update_ratios for r in window if r.update_ratios]
    if ratios:  # --log-update-to-weight-ratios, at the log line's iteration
        record |= ratios[-1]  # update_ratio/<layer group>, update_rms/<optimizer>
    activations = [r.activations for r in window if r.activations]
    if activations:  # --log-activation-stats
        record |= activations[-1]
    projections = [r.pcgrad_projections for r in window if r.pcgrad_projections is not None]
    if projections:  # --pcgrad: the projections made over the window's steps
        record["pcgrad_projections"] = sum(projections)
    parts = [r.part_norms for r in window if r.part_norms]
    if parts:  # the latest breakdown in the window (--log-grad-norms-interval)
        record |= {f"grad_norm/{label}": value for label, value in parts[-1].items()}
    # the window ends here: its rates, and the seconds per iteration of each part of its steps
    # (parallel/timing.py); logging it counts towards the next window
    times = run.features.times
    record |= run.throughput.rates(tokens, len(window))
    parts = times.take()
    run.throughput.reset()
    record |= {f"time/{part}": s / len(window) for part, s in sorted(parts.items())}
    if run.stragglers is not None:  # (collective: every rank logs a window)
        per_rank = run.stragglers.gather(parts, len(window))
        record["own_time_per_rank"] = per_rank
        record["own_time_max_over_median"] = max(per_rank) / max(statistics.median(per_rank), 1e-12)
        for line in run.stragglers.lines(per_rank, run.progress.counters.iteration):
            run.writer.print(line)
    with measure(times, "log"):
        _write(run, record, loss)


def log_iteration(run: Run, result: IterationResult) -> None:
    """Megatron-LM's per-iteration TensorBoard scalars (every --tensorboard-log-interval)."""
    c = run.progress.counters
    record = {
        "iteration": c.iteration,
        "consumed_samples": c.consumed_samples,
        "lm_loss": result.lm_loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "loss_scale": result.loss_scale,
        "batch_size": result.batch_size,
        "params_norm": result.params_norm,
        "num_zeros": result.num_zeros,
    }
    if run.cfg.logging.log_memory_to_tensorboard:
        record |= cuda_memory_tags(run.state.device)
    if result.moe is not None:  # Megatron-LM writes its MoE losses every iteration
        record |= result.moe.losses
    run.writer.log_iteration(record, c.iteration)


def _write(run: Run, record: dict, loss: float) -> None:
    """The record to the metrics writers, and its console line."""
    c, iterations = run.progress.counters, run.cfg.training.train_iters
    run.writer.log(record, c.iteration)
    mfu = f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""
    grad = f"{record['grad_norm']:.3f}" if record["grad_norm"] is not None else "skipped"
    if "num_zeros" in record:
        grad += f" | num zeros {record['num_zeros']}"
    if "params_norm" in record:
        grad += f" | params norm {record['params_norm']:.3f}"
    run.writer.print(
        f"iteration {c.iteration:6d}/{iterations} | consumed {c.consumed_samples} | "
        f"lm loss {loss:.4f} | lr {record['lr']:.3e} | grad norm {grad} | "
        f"{record['tokens_per_sec']:,.0f} tokens/s | {record['tflops_per_device']:.3f} "
        f"TFLOP/s/device{mfu} | skipped {c.skipped_iters} | mem {record['mem_gb']:.2f} GB"
        + _moe_text(record)
        + "".join(
            f" | {key.removesuffix('_loss')} loss {value:.4f}"
            for key, value in record.items()
            if key.startswith("mtp_") and key.endswith("_loss")
        )
        + _domains_text(record)
        + "".join(
            f" | cos {key.removeprefix('grad_cosine/')} {value:.3f}"
            for key, value in record.items()
            if key.startswith("grad_cosine/") and key.count("/") == 1
        )
        + (
            f" | pcgrad projections {record['pcgrad_projections']}"
            if "pcgrad_projections" in record
            else ""
        )
    )


def _moe_text(record: dict) -> str:
    """A mixture of experts' losses and load on the console line."""
    parts = [f"{name} {record[name]:.4f}" for name in LOSS_NAMES if name in record]
    if "moe_load_imbalance" in record:
        parts.append(f"expert load max/mean {record['moe_load_imbalance']:.2f}")
    if "moe_dropped_fraction" in record:
        parts.append(f"dropped {record['moe_dropped_fraction']:.1%}")
    return "".join(f" | {part}" for part in parts)


def _mix_keys(run: Run) -> dict:
    """A weighted blend's weights in the window's last step (`mix_weight/<name>`), and the
    tokens each dataset of a blend of .bin/.idx datasets has given so far
    (`consumed_tokens/<name>`, samples x --seq-length)."""
    keys = {}
    if run.mix is not None:
        phase = run.mix.phase_at(max(0, run.progress.counters.iteration - 1))
        keys |= {f"mix_weight/{n}": w for n, w in zip(run.mix.names, phase.weights, strict=False)}
    split = run.datasets[0]
    if len(split.names) > 1:
        given = split.consumed_per_dataset(run.progress.counters.consumed_samples)
        if given is not None:
            seq = run.cfg.model.seq_length
            keys |= {
                f"consumed_tokens/{n}": int(k) * seq
                for n, k in zip(split.names, given, strict=False)
            }
    return keys


def _window_domain_losses(window: list[IterationResult], names: tuple[str, ...]) -> dict:
    """Each blended dataset's loss over the window's iterations (`lm_loss/<name>`) and its
    share of the loss's token weight (`lm_loss_share/<name>`): the shares add up to 1 and
    sum(share * loss) is the window's mean loss."""
    found = [r.domain_parts for r in window if r.domain_parts]
    if not found:
        return {}
    summed = [sum(values) / len(found) for values in zip(*found, strict=False)]
    return _domain_keys(domain_losses(summed, names))


def _window_mtp_losses(window: list[IterationResult]) -> dict:
    """Multi-token prediction's loss of each depth over the window (`mtp_<k>_loss`, written
    to TensorBoard as Megatron-LM's `mtp_<k> loss`)."""
    found = [r.mtp_losses for r in window if r.mtp_losses]
    if not found:
        return {}
    means = [sum(values) / len(found) for values in zip(*found, strict=True)]
    return {f"mtp_{depth}_loss": value for depth, value in enumerate(means, start=1)}


def _domain_keys(domains: dict) -> dict:
    """{dataset: (loss, share)} as record keys lm_loss/<name> and lm_loss_share/<name>."""
    out = {}
    for name, (loss, share) in domains.items():
        out[f"lm_loss/{name}"], out[f"lm_loss_share/{name}"] = loss, share
    return out


def _domains_text(record: dict) -> str:
    """The record's per-dataset losses for a console line."""
    return "".join(
        f" | {key.removeprefix('lm_loss/')} {value:.4f}"
        for key, value in record.items()
        if key.startswith("lm_loss/")
    )


def log_eval(run: Run, name: str, result: tuple[float, dict] | None) -> None:
    """The log line (and metrics record) of an evaluation (loss, {dataset: (loss, share)})."""
    if result is None:
        return
    loss, domains = result
    ppl = math.exp(min(loss, 50.0))
    c = run.progress.counters
    record = {"iteration": c.iteration, "consumed_samples": c.consumed_samples}
    record |= {"split": name, "lm_loss": loss, "ppl": ppl} | _domain_keys(domains)
    gap = ""
    train = run.progress.last_train_loss
    if name == "valid" and train is not None and math.isfinite(loss):
        record["train_valid_gap"] = loss - train  # > 0: the valid loss above the training's
        gap = f" | gap to training {loss - train:+.4f}"
    run.writer.log(record, c.iteration, name)
    run.writer.print(
        f"{name} at iteration {c.iteration}: lm loss {loss:.4f} | perplexity "
        f"{ppl:.2f}{gap}{_domains_text(record)}"
    )


def log_tasks(run: Run) -> None:
    """--eval-tasks scored under the run's layout: a console line per task and one record
    (split "tasks": acc/<task>, acc_norm/<task>, gold_ll/<task>: the gold choices' mean
    log-likelihood). Collective on every rank."""
    tasks, c = run.eval_tasks, run.progress.counters
    decoding = Decoding(
        run.chunks, run.schedule, run.state, run.cfg.model.seq_length,
        run.cfg.model.vocab_size, run.cfg.training.micro_batch_size,
    )  # fmt: skip
    results = score_tasks(decoding, tasks.tasks, tasks.pad, tasks.tokenizer, run.packing)
    record = {"iteration": c.iteration, "consumed_samples": c.consumed_samples, "split": "tasks"}
    for name, found in results.items():
        record |= {f"acc/{name}": found["acc"], f"acc_norm/{name}": found["acc_norm"],
                   f"gold_ll/{name}": found["gold_ll"]}  # fmt: skip
        run.writer.print(
            f"task {name} at iteration {c.iteration}: acc {found['acc']:.4f} | acc_norm "
            f"{found['acc_norm']:.4f} | gold log-likelihood {found['gold_ll']:.4f} | "
            f"{found['n']} questions, 0-shot"
        )
    run.writer.log(record, c.iteration, "tasks")


def log_samples(run: Run) -> None:
    """Greedy and sampled continuations of every --eval-prompts prompt: printed, in the JSONL
    (a record with `samples`) and as TensorBoard text. Collective on every rank."""
    prompts, c = run.eval_prompts, run.progress.counters
    tokenizer = prompts.tokenizer
    eod = getattr(tokenizer, "eod", None)
    decoding = Decoding(
        run.chunks,
        run.schedule,
        run.state,
        run.cfg.model.seq_length,
        run.cfg.model.vocab_size,
        run.cfg.training.micro_batch_size,
    )
    new = prompts.max_new_tokens
    greedy = decode(decoding, prompts.ids, new, None, eod=eod)
    generator = torch.Generator().manual_seed(run.cfg.training.seed * 1_000_003 + c.iteration)
    sampled = decode(decoding, prompts.ids, new, generator, prompts.temperature, prompts.top_p, eod)
    samples = [
        {
            "prompt": tokenizer.detokenize(ids),
            "greedy": tokenizer.detokenize(g),
            "sampled": tokenizer.detokenize(s),
            "greedy_ids": g,
            "sampled_ids": s,
        }
        for ids, g, s in zip(prompts.ids, greedy, sampled, strict=False)
    ]
    record = {"iteration": c.iteration, "consumed_samples": c.consumed_samples, "samples": samples}
    run.writer.log_samples(record, c.iteration)
    knobs = f"temperature {prompts.temperature}, top-p {prompts.top_p}"
    for k, sample in enumerate(samples, start=1):
        run.writer.print(f"sample {k} at iteration {c.iteration}, greedy: {sample['prompt']!r} -> "
                         f"{sample['greedy']!r}")  # fmt: skip
        run.writer.print(f"sample {k} at iteration {c.iteration}, sampled ({knobs}): "
                         f"{sample['prompt']!r} -> {sample['sampled']!r}")  # fmt: skip
