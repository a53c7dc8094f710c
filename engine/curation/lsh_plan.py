"""How MinHash deduplication finds pairs: the bands, rows and verification that find a pair at
the threshold with a chosen probability (`recall`, 0.98 by default), removing as few pairs
0.1 below it as that allows.

Two documents of Jaccard similarity s agree in each signature position with probability s,
independently. With `bands` bands of `rows` positions they are candidates when some band
agrees whole; verification then joins them only if at least `agree` of the bands * rows
positions agree. The probability of both, found(s), is computed exactly (the distribution of
the agreeing count jointly with "some band whole", band by band), not by treating the two as
independent. found(s) grows with s, so a pair at or above the threshold is found with at
least found(threshold).

The plan: for every rows count (the bands as many as fit in num_perm), the strictest `agree`
whose found(threshold) still reaches `recall`; of these, the one with the least
found(threshold - 0.1). Without verification `agree` is 0 and the bands and rows alone are
chosen so. (datasketch's choice, the least sum of the areas under and over the S-curve, gave
9 x 13 at 0.8 and 128 hash functions, which verified at the threshold finds a pair at 0.8 28%
of the time and one at 0.85 67%.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

FALSE_POSITIVE_GAP = 0.1  # found(threshold - gap) is what the plan makes small


@dataclass(frozen=True)
class LSHPlan:
    bands: int
    rows: int
    agree: int  # agreeing positions verification asks for (0: no verification)

    def found(self, similarity: float) -> float:
        """The probability that a pair of this Jaccard similarity is found."""
        return float(_tail(_joint(similarity, self.bands, self.rows))[self.agree])


def _joint(s: float, bands: int, rows: int) -> np.ndarray:
    """P(count == c and some band agrees whole), c = 0 .. bands * rows."""
    per_band = [math.comb(rows, j) * s**j * (1 - s) ** (rows - j) for j in range(rows + 1)]
    width = bands * rows + 1
    none, whole = np.zeros(width), np.zeros(width)
    none[0] = 1.0
    for _ in range(bands):
        next_none, next_whole = np.zeros(width), np.zeros(width)
        for j, p in enumerate(per_band):
            shifted_none = np.concatenate([np.zeros(j), none[: width - j]])
            shifted_whole = np.concatenate([np.zeros(j), whole[: width - j]])
            next_whole += p * shifted_whole
            if j == rows:
                next_whole += p * shifted_none
            else:
                next_none += p * shifted_none
        none, whole = next_none, next_whole
    return whole


def _tail(p: np.ndarray) -> np.ndarray:
    """tail[m] = P(count >= m and candidate)."""
    return np.cumsum(p[::-1])[::-1]


@functools.cache  # a pure function, 0.14 s a call: a run's configs are read once per task
def plan_lsh(threshold: float, num_perm: int, recall: float, verify: bool) -> LSHPlan:
    """The plan for a threshold (module docstring)."""
    best, best_false = None, math.inf
    low = max(threshold - FALSE_POSITIVE_GAP, 0.0)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        at_threshold = _tail(_joint(threshold, bands, rows))
        reaching = np.flatnonzero(at_threshold >= recall)
        if not len(reaching):
            continue
        agree = int(reaching.max()) if verify else 0
        false = float(_tail(_joint(low, bands, rows))[agree])
        if false < best_false - 1e-12:
            best, best_false = LSHPlan(bands, rows, agree), false
    if best is None:
        raise ValueError(
            f"no bands and rows of {num_perm} hash functions find a pair at {threshold} with "
            f"probability {recall}; give a larger num_perm or a lower recall"
        )
    return best
