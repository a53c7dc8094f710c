"""Scaling laws fitted to runs (engine/planning/scaling_fit.py, tools/fit_scaling.py): the
robust fit recovers the parameters of a known power law, the compute-optimal split is the
least loss at that compute, and the tool reads what real runs write beside their logs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.planning.scaling_fit import (
    CHINCHILLA,
    ComputeLaw,
    ParameterDataLaw,
    fit_compute,
    fit_parameter_data,
    frontier,
)
from tests.cli import one_line_error, run_tool
from tests.distributed import run_ranks
from tests.test_rerun import _train
from tests.test_restarts import SMALL_RUN


def _close(fitted: dict, true: dict, tolerance: float = 0.05) -> None:
    for key, value in true.items():
        assert abs(fitted[key] - value) <= tolerance * abs(value), (key, fitted, true)


def test_the_fits_recover_known_power_laws():
    law = ParameterDataLaw(**CHINCHILLA)
    n, d = (g.ravel() for g in np.meshgrid(np.logspace(7, 9, 5), np.logspace(9, 11, 5)))
    noise = np.exp(np.random.default_rng(1).normal(0, 0.002, n.shape))  # 0.2% on the loss
    _close(fit_parameter_data(n, d, law.loss(n, d) * noise).as_dict(), CHINCHILLA)
    true = {"a": 1500.0, "b": 0.15, "e": 1.8}
    compute = np.logspace(15, 20, 12)
    fitted = fit_compute(compute, ComputeLaw(**true).loss(compute))
    _close(fitted.as_dict(), true)


def test_the_compute_optimal_split_is_the_least_loss_at_that_compute():
    law, k, budget = ParameterDataLaw(**CHINCHILLA), 6.0, 5.76e23  # Chinchilla's budget
    n, d = law.optimal(budget, k)
    assert n * d * k == pytest.approx(budget)
    sizes = np.logspace(np.log10(n) - 1, np.log10(n) + 1, 20001)
    best = sizes[np.argmin(law.loss(sizes, budget / (k * sizes)))]
    assert best == pytest.approx(n, rel=1e-3)
    assert 3e10 < n < 1e11  # the paper's approach 3 gives tens of billions at that budget


def test_a_fit_the_runs_do_not_determine_is_flagged():
    assert not ParameterDataLaw(**CHINCHILLA).undetermined(2.0)
    assert ParameterDataLaw(E=1e-200, A=1e130, B=19.0, alpha=21.9, beta=0.1).undetermined(5.2)
    assert ParameterDataLaw(E=1e-5, A=400.0, B=400.0, alpha=0.3, beta=0.3).undetermined(2.0)


def test_the_frontier_keeps_points_no_cheaper_point_beats():
    compute = [1.0, 2.0, 3.0, 4.0, 5.0]
    loss = [5.0, 5.5, 4.0, 4.2, 3.0]
    assert frontier(compute, loss) == [0, 2, 4]


def _synthetic_run(folder, law: ParameterDataLaw, parameters: float, iterations: int):
    """A run's log and description as the engine writes them, with losses from `law` (the
    tool is checked against a law it must find; real runs' files are checked below)."""
    seq, batch, flops = 256, 8, 6.0 * parameters
    folder.mkdir(parents=True)
    records = []
    for it in range(10, iterations + 1, 10):
        tokens = it * batch * seq
        records.append({"iteration": it, "consumed_samples": it * batch,
                        "lm_loss": float(law.loss(parameters, tokens))})  # fmt: skip
    records.append({**records[-1], "split": "valid"})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    description = {"parameters": parameters, "flops_per_token": flops, "seq_length": seq}
    (folder / "metrics.run.json").write_text(json.dumps(description))


def test_the_tool_fits_a_sweep_folder_and_refuses_too_few_points(tmp_path):
    law = ParameterDataLaw(E=2.0, A=300.0, B=200.0, alpha=0.4, beta=0.3)
    for parameters in (1e6, 3e6, 1e7):
        for iterations in (100, 300, 1000):
            _synthetic_run(tmp_path / "sweep" / f"n{parameters:g}_i{iterations}", law,
                           parameters, iterations)  # fmt: skip
    out = tmp_path / "fit.json"
    result = run_tool(
        "fit_scaling.py", "--runs", str(tmp_path / "sweep"), "--bootstrap", "10",
        "--output", str(tmp_path / "scaling.png"), "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "on the final losses of 9 runs" in result.stdout
    assert "compute-optimal for" in result.stdout and "Chinchilla 0.34" in result.stdout
    fitted = json.loads(out.read_text())
    _close(fitted["data_law"], law.as_dict())
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"

    few = tmp_path / "few"
    _synthetic_run(few / "one", law, 1e6, 30)
    result = run_tool("fit_scaling.py", "--runs", str(few), "--skip-first-fraction", "0.5")
    assert result.returncode == 2
    assert one_line_error(result).startswith("error: --runs: 2 points on the")
    result = run_tool("fit_scaling.py", "--runs", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "no such file or folder" in one_line_error(result)


def test_a_run_describes_itself_beside_its_log(dataset_prefix, tokenizer_model, tmp_path):
    """What the fit reads is the engine's own count: the model's parameters and the FLOPs per
    token its throughput line uses."""
    from engine.monitor.metrics import model_flops_per_token
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    data = ["--data-path", dataset_prefix, "--tokenizer-type", "SentencePieceTokenizer"]
    data += ["--tokenizer-model", tokenizer_model, "--train-iters", "3"]
    log = tmp_path / "run" / "metrics.jsonl"
    run_ranks(_train, 1, [*SMALL_RUN, *data, "--log-jsonl", str(log), "--seed", "5"], {})
    described = json.loads((tmp_path / "run" / "metrics.run.json").read_text())
    model = prepare(parse([*SMALL_RUN, *data]), 1).model
    from tests.test_parameter_count import _built

    [(total, _, _)] = run_ranks(_built, 1, model)
    assert described["parameters"] == total
    flops = model_flops_per_token(model, model.padded_vocab_size(1))
    assert described["flops_per_token"] == flops and described["seq_length"] == 32
    assert described["seed"] == 5 and described["configuration"]["training"]["seed"] == 5
