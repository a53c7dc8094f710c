"""Scaling laws fitted to a project's own runs (tools/fit_scaling.py).

Two laws, both fitted in log space with a Huber loss (delta 1e-3) minimised by L-BFGS from a
grid of starting points, the robust fit of the Chinchilla paper's third approach (Hoffmann et
al. 2022, appendix D.2):

- loss against training compute, L(C) = a C^-b + e, fitted to the points of the runs' logs
  that no other point beats (less or equal compute, lower loss): the compute frontier;
- loss against parameters and tokens, L(N, D) = E + A / N^alpha + B / D^beta, fitted to each
  run's final loss.

With C = k N D (k: the runs' training FLOPs per token per parameter, about 6), the L(N, D) fit
gives the compute-optimal split of a budget: N_opt = G (C/k)^(beta/(alpha+beta)) and
D_opt = (C/k) / N_opt, G = (alpha A / (beta B))^(1/(alpha+beta)). Confidence intervals come
from refitting resamples of the points (bootstrap, percentiles).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from engine.errors import InputError

HUBER_DELTA = 1e-3
# Hoffmann et al.'s approach 3 estimates (their table A3), printed beside a fit
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
MIN_POINTS = 4
SCREENED = 12  # the grid's starting points a fit descends from


@dataclass(frozen=True)
class ComputeLaw:
    """L(C) = a C^-b + e."""

    a: float
    b: float
    e: float

    def loss(self, compute):
        return self.a * np.asarray(compute, dtype=float) ** -self.b + self.e

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "e": self.e}


@dataclass(frozen=True)
class ParameterDataLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimal(self, compute: float, flops_per_parameter_token: float) -> tuple[float, float]:
        """(N, D) of least loss for `compute` FLOPs, C = k N D."""
        alpha, beta = self.alpha, self.beta
        g = (alpha * self.A / (beta * self.B)) ** (1 / (alpha + beta))
        products = compute / flops_per_parameter_token
        n = g * products ** (beta / (alpha + beta))
        return n, products / n

    def as_dict(self) -> dict:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}

    def undetermined(self, least_loss: float) -> bool:
        """Whether the runs leave the law undetermined: an exponent beyond any published fit
        (above 3: a step, not a power law) or an irreducible loss at zero (below a thousandth
        of the least loss seen)."""
        return max(self.alpha, self.beta) > 3 or least_loss > 1000 * self.E


def _huber(r: np.ndarray) -> tuple[float, np.ndarray]:
    """Huber loss of the residuals and its derivative."""
    small = np.abs(r) <= HUBER_DELTA
    value = np.where(small, 0.5 * r**2, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
    return float(value.sum()), np.where(small, r, HUBER_DELTA * np.sign(r))


def _log_sum_exp_fit(terms, grads, y):
    """Objective and gradient for log L = LSE(terms): `terms` (k, n) rows, `grads` the
    derivative of each row by the parameters (k, p, n)."""
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    lse = top + np.log(total)
    value, slope = _huber(lse - y)
    weights /= total
    gradient = np.einsum("kn,kpn,n->p", weights, grads, slope)
    return value, gradient


def _minimize(objective, starts: list[np.ndarray]) -> np.ndarray:
    """L-BFGS from the `starts` whose objective is lowest (SCREENED of them: the grid is
    screened by value first, as a full descent from each of thousands of points takes minutes)."""
    from scipy.optimize import minimize

    with np.errstate(over="ignore", invalid="ignore"):
        values = np.array([objective(s)[0] for s in starts])
    values[~np.isfinite(values)] = np.inf
    best, best_value = None, np.inf
    for index in np.argsort(values, kind="stable")[:SCREENED]:
        start = starts[index]
        with np.errstate(over="ignore", invalid="ignore"):
            found = minimize(
                objective, start, jac=True, method="L-BFGS-B",
                options={"maxiter": 1000, "gtol": 1e-12, "ftol": 1e-15},
            )  # fmt: skip
        if np.isfinite(found.fun) and found.fun < best_value:
            best, best_value = found.x, found.fun
    if best is None:
        raise InputError("the fit found no finite solution from any starting point")
    return best


def _compute_objective(log_c: np.ndarray, y: np.ndarray):
    ones, zeros = np.ones_like(log_c), np.zeros_like(log_c)

    def objective(p):
        log_a, b, log_e = p
        terms = np.stack([log_a - b * log_c, log_e * ones])
        grads = np.stack([np.stack([ones, -log_c, zeros]), np.stack([zeros, zeros, ones])])
        return _log_sum_exp_fit(terms, grads, y)

    return objective


COMPUTE_GRID = [
    np.array(p, dtype=float)
    for p in itertools.product((0, 5, 10, 20, 30), (0.05, 0.1, 0.2, 0.4), (-1, 0, 0.5, 1, 2))
]


def fit_compute(compute, loss, starts: list[np.ndarray] | None = None) -> ComputeLaw:
    """L(C) = a C^-b + e by the robust fit."""
    log_c, y = np.log(np.asarray(compute, dtype=float)), np.log(np.asarray(loss, dtype=float))
    p = _minimize(_compute_objective(log_c, y), starts or COMPUTE_GRID)
    return ComputeLaw(float(np.exp(p[0])), float(p[1]), float(np.exp(p[2])))


def _parameter_data_objective(log_n: np.ndarray, log_d: np.ndarray, y: np.ndarray):
    ones, zeros = np.ones_like(log_n), np.zeros_like(log_n)

    def objective(p):
        a, b, e, alpha, beta = p
        terms = np.stack([a - alpha * log_n, b - beta * log_d, e * ones])
        grads = np.stack([
            np.stack([ones, zeros, zeros, -log_n, zeros]),
            np.stack([zeros, ones, zeros, zeros, -log_d]),
            np.stack([zeros, zeros, ones, zeros, zeros]),
        ])  # fmt: skip
        return _log_sum_exp_fit(terms, grads, y)

    return objective


# Hoffmann et al.'s grid: a, b in {0, 5, .., 25}, e in {-1, -.5, .., 1}, alpha, beta in {0, .5,
# .., 2}; the exponents start just above 0 (at 0 a term is a constant, the same as e's)
PARAMETER_DATA_GRID = [
    np.array([a, b, e, alpha, beta], dtype=float)
    for a, b, e, alpha, beta in itertools.product(
        range(0, 30, 5), range(0, 30, 5), (-1, -0.5, 0, 0.5, 1),
        (0.1, 0.5, 1.0, 1.5, 2.0), (0.1, 0.5, 1.0, 1.5, 2.0),
    )
]  # fmt: skip


def fit_parameter_data(n, d, loss, starts: list[np.ndarray] | None = None) -> ParameterDataLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta by the robust fit."""
    log_n, log_d = np.log(np.asarray(n, dtype=float)), np.log(np.asarray(d, dtype=float))
    y = np.log(np.asarray(loss, dtype=float))
    p = _minimize(_parameter_data_objective(log_n, log_d, y), starts or PARAMETER_DATA_GRID)
    a, b, e, alpha, beta = (float(v) for v in p)
    return ParameterDataLaw(float(np.exp(e)), float(np.exp(a)), float(np.exp(b)), alpha, beta)


def starts_near(law: ParameterDataLaw | ComputeLaw) -> list[np.ndarray]:
    """The starting point of a resample's refit: the full fit's solution."""
    if isinstance(law, ComputeLaw):
        return [np.array([np.log(law.a), law.b, np.log(law.e)])]
    return [np.array([np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta])]


def bootstrap(fit, columns: list[np.ndarray], law, resamples: int, seed: int = 0) -> list:
    """The laws fitted to `resamples` resamples (with replacement) of the points; `fit` takes
    the columns and `starts=`. Resamples with fewer distinct points than MIN_POINTS are
    drawn again."""
    rng = np.random.default_rng(seed)
    count, laws, starts = len(columns[0]), [], starts_near(law)
    while len(laws) < resamples:
        pick = rng.integers(0, count, count)
        if len(set(pick.tolist())) < MIN_POINTS:
            continue
        laws.append(fit(*(np.asarray(c)[pick] for c in columns), starts=starts))
    return laws


def interval(values, level: float = 0.95) -> tuple[float, float]:
    """The central `level` of the bootstrap values."""
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(np.asarray(values, dtype=float), [tail, 100 - tail])
    return float(low), float(high)


def frontier(compute, loss) -> list[int]:
    """Indices of the points no other point beats: sorted by compute, each one's loss below
    every cheaper point's."""
    order = np.lexsort((np.asarray(loss, dtype=float), np.asarray(compute, dtype=float)))
    kept, best = [], np.inf
    for i in order:
        if loss[i] < best:
            kept.append(int(i))
            best = loss[i]
    return kept
