"""tools/compute_budget.py against the Chinchilla paper's own table of compute-optimal sizes
(Hoffmann et al. 2022, Table 3), and its fitted law's closed-form optimum against a direct
search."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.planning.budget import CHINCHILLA, Cluster, optimal_by_ratio, parse_amount, solve
from tests.cli import one_line_error, run_tool

# Table 3: parameters, training FLOPs, training tokens
CHINCHILLA_TABLE_3 = [
    (400e6, 1.92e19, 8.0e9),
    (1e9, 1.21e20, 20.2e9),
    (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12),
    (175e9, 3.85e24, 3.7e12),
    (280e9, 9.90e24, 5.9e12),
    (520e9, 3.43e25, 11.0e12),
    (1e12, 1.27e26, 21.2e12),
    (10e12, 1.30e28, 216.2e12),
]


@pytest.mark.parametrize("parameters, flops, tokens", CHINCHILLA_TABLE_3)
def test_twenty_tokens_per_parameter_reproduces_table_3(parameters, flops, tokens):
    n, d = optimal_by_ratio(flops)
    assert n == pytest.approx(parameters, rel=0.08)
    assert d == pytest.approx(tokens, rel=0.08)
    # and the table's FLOPs are 6 N D of its own sizes, to its rounding of the tokens
    assert solve(parameters=parameters, tokens=tokens)["flops"] == pytest.approx(flops, rel=0.05)


def test_the_fitted_optimum_is_the_least_loss_at_its_compute():
    for flops in (1e20, 5.76e23, 1e26):
        n, d = CHINCHILLA.optimal(flops)
        assert 6 * n * d == pytest.approx(flops)
        grid = np.geomspace(n / 10, n * 10, 20001)
        losses = [CHINCHILLA.loss(x, flops / (6 * x)) for x in grid]
        best = grid[int(np.argmin(losses))]
        assert best == pytest.approx(n, rel=1e-3)
        # its exponents: N grows as C^0.45, D as C^0.55 (the paper's a = 0.46, b = 0.54)
    n1, _ = CHINCHILLA.optimal(1e22)
    n2, _ = CHINCHILLA.optimal(1e24)
    assert math.log(n2 / n1) / math.log(100) == pytest.approx(0.28 / 0.62)


def test_any_two_give_the_rest():
    cluster = Cluster(gpus=256, peak_tflops=989.0, mfu=0.4)
    out = solve(parameters=7e9, tokens=2e12, cluster=cluster)
    assert out["flops"] == 8.4e22
    assert out["days"] == pytest.approx(8.4e22 / (256 * 989e12 * 0.4) / 86400)
    assert out["gpu_hours"] == pytest.approx(out["days"] * 24 * 256)
    back = solve(parameters=7e9, cluster=cluster, days=out["days"])
    assert back["tokens"] == pytest.approx(2e12)
    assert solve(tokens=2e12, flops=8.4e22)["parameters"] == pytest.approx(7e9)
    only = solve(flops=5.76e23)
    assert only["tokens_per_parameter"] == pytest.approx(20)
    with pytest.raises(ConfigError, match="over-determine"):
        solve(parameters=1e9, tokens=1e10, flops=1e20)
    assert parse_amount("--tokens", "1.4T") == 1.4e12
    assert parse_amount("--flops", "5.76e23") == 5.76e23


def test_the_tool(tmp_path):
    out = tmp_path / "b.json"
    result = run_tool("compute_budget.py", "--parameters", "7B", "--tokens", "2T", "--gpu",
                      "H100", "--gpus", "256", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tokens/parameter   285.7" in result.stdout and "Llama 2 7B" in result.stdout
    assert json.loads(out.read_text())["flops"] == 8.4e22
    line = one_line_error(run_tool("compute_budget.py", "--parameters", "7B", "--gpu", "X1",
                                   "--gpus", "8"))  # fmt: skip
    assert "--gpu X1: no bf16 peak known; one of:" in line


def test_bad_amounts_are_refused(tmp_path):
    assert parse_amount("--parameters", "7b") == 7e9  # suffixes in either case
    for flag, text in (("--flops", "1e400"), ("--parameters", "0"), ("--tokens", "many")):
        with pytest.raises(ConfigError, match=flag):
            parse_amount(flag, text)
    line = one_line_error(run_tool("compute_budget.py", "--parameters", "7B", "--json",
                                   str(tmp_path / "no" / "such" / "b.json")))  # fmt: skip
    assert "--json" in line and "cannot write it" in line
    line = one_line_error(run_tool("compute_budget.py", "--parameters", "7B", "--gpu", "H100",
                                   "--gpus", "8", "--mfu", "0"))  # fmt: skip
    assert line.startswith("error: --mfu 0.0:")


def test_days_at_the_planners_rate(tmp_path):
    """--plan: the cluster and MFU of tools/plan.py's best fitting layout of a model."""
    plan = tmp_path / "plan.json"
    model = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "4096", "--vocab-size", "32000", "--attention-dropout", "0.0",
             "--global-batch-size", "512", "--gpu", "h100", "--gpus", "64"]  # fmt: skip
    assert run_tool("plan.py", *model, "--top", "3", "--json", str(plan)).returncode == 0
    best = json.loads(plan.read_text())[0]
    out = tmp_path / "b.json"
    result = run_tool("compute_budget.py", "--parameters", "7B", "--tokens", "2T", "--plan",
                      str(plan), "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    seconds = 8.4e22 / (64 * best["prediction"]["tflops"] * 1e12)
    assert json.loads(out.read_text())["days"] == pytest.approx(seconds / 86400, rel=1e-9)
    assert f"at {best['prediction']['mfu']:.1%} MFU (tools/plan.py's best layout)" in result.stdout
    line = one_line_error(run_tool("compute_budget.py", "--parameters", "7B", "--plan",
                                   str(plan), "--gpus", "8"))  # fmt: skip
    assert "--plan gives the cluster and its MFU" in line
    (tmp_path / "bad.json").write_text('{"rows": 1}')
    line = one_line_error(run_tool("compute_budget.py", "--parameters", "7B", "--plan",
                                   str(tmp_path / "bad.json")))  # fmt: skip
    assert "not a file of tools/plan.py --json" in line
