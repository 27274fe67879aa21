"""From canary guesses to epsilon: one-run auditing's lower bound and the one-shot estimate.

One-run auditing (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with One (1) Training
Run"): m canaries, each included independently with probability 1/2; after one run the auditor
guesses "in" or "out" for r of them and abstains on the rest. If the run is (eps, delta)-DP with
respect to each canary, v or more correct guesses have probability at most

    f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i,   f(v) = P[Binomial(r, p) >= v],

with p = e^eps / (1 + e^eps) (their Theorem 3; `p_value` is their appendix's algorithm for it).
The smallest eps that this p-value does not reject at confidence 1 - beta is a lower bound on the
run's true epsilon, with probability at least 1 - beta over the run's randomness.

The one-shot estimate (Andrew et al. 2024, "One-shot Empirical Privacy Estimation for Federated
Learning") fits a Gaussian to the included and the excluded canaries' scores and reports the
epsilon of the Gaussian mechanism whose two outputs are that far apart: an estimate, not a bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, stats


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[at least v of r guesses correct] under (epsilon, delta)-DP, m canaries (Theorem 3).

    Raises:
        ValueError: counts or parameters out of range (0 <= v <= r <= m, eps >= 0, delta in [0, 1]).
    """
    if not (0 <= v <= r <= m and epsilon >= 0 and 0 <= delta <= 1):
        msg = (
            "need 0 <= v <= r <= m, eps >= 0 and 0 <= delta <= 1 "
            f"(got m={m}, r={r}, v={v}, eps={epsilon}, delta={delta})"
        )
        raise ValueError(msg)
    p = 1 / (1 + math.exp(-epsilon))  # the accuracy of eps-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, p))  # f(v)
    # (f(v - i) - f(v)) / i = P[v - i <= Binomial(r, p) < v] / i, for i = 1..v
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)) / np.arange(1, v + 1)
    worst = float(below.max()) if v else 0.0
    return min(1.0, tail + 2 * m * delta * worst)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest eps rejected at level `beta` by v correct of r guesses (0 if none is).

    Bisection to 1e-6 of the p-value, which decreases in eps; eps above 100 is reported as 100
    (p-values there underflow).
    """
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while high < 100 and p_value(m, r, v, high, delta) < beta:
        low, high = high, 2 * high
    if high >= 100:
        return 100.0
    while high - low > 1e-6:
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) < beta else (low, middle)
    return low


def guesses(scores: ArrayLike, r: int) -> np.ndarray:
    """+1 ("in") for the r/2 highest scores, -1 ("out") for the r/2 lowest, 0 elsewhere."""
    order = np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")
    guessed = np.zeros(len(order), dtype=np.int64)
    half = r // 2
    if half:
        guessed[order[:half]] = -1
        guessed[order[-half:]] = 1
    return guessed


def audit_lower_bound(
    scores: ArrayLike,
    included: ArrayLike,
    delta: float,
    *,
    beta: float = 0.05,
    fractions: Sequence[float] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
) -> tuple[float, int, int]:
    """(epsilon lower bound, guesses, correct ones) at confidence 1 - beta.

    The guess counts r are fixed before the run (`fractions` of the canaries); each is tested
    at beta / len(fractions) (Bonferroni), so taking the best of them keeps the confidence.
    """
    truth = np.where(np.asarray(included, dtype=bool), 1, -1)
    m = len(truth)
    best = (0.0, 0, 0)
    for fraction in fractions:
        r = 2 * max(1, int(fraction * m) // 2)
        if r > m:
            continue
        guessed = guesses(scores, r)
        correct = int(np.sum(guessed == truth))
        bound = epsilon_lower_bound(m, r, correct, delta, beta / len(fractions))
        if not best[1] or bound > best[0]:
            best = (bound, r, correct)
    return best


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon at delta of the Gaussian mechanism with sensitivity / sigma = mu (Balle-Wang 2018).

    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), solved for eps (0 if the
    mechanism is already (0, delta)-DP; inf for mu = inf).
    """
    if not mu > 0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def excess(eps: float) -> float:
        # e^eps Phi(x) as exp(eps + log Phi(x)): no overflow at large eps
        second = math.exp(eps + float(stats.norm.logcdf(-mu / 2 - eps / mu)))
        return float(stats.norm.cdf(mu / 2 - eps / mu)) - second - delta

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
    return float(optimize.brentq(excess, 0.0, high, xtol=1e-10))


def one_shot_estimate(scores: ArrayLike, included: ArrayLike, delta: float) -> float:
    """Andrew et al.'s estimate: the Gaussian mechanism as far apart as the two score groups.

    mu = (mean of included - mean of excluded) / pooled standard deviation; its epsilon at
    delta. Not a bound: the scores of a sampled mechanism are not Gaussian.
    """
    values = np.asarray(scores, dtype=np.float64)
    mask = np.asarray(included, dtype=bool)
    inside, outside = values[mask], values[~mask]
    if len(inside) < 2 or len(outside) < 2:
        msg = "the one-shot estimate needs at least two canaries in each group"
        raise ValueError(msg)
    pooled = math.sqrt((float(np.var(inside, ddof=1)) + float(np.var(outside, ddof=1))) / 2)
    gap = float(np.mean(inside) - np.mean(outside))
    mu = math.inf if pooled == 0 and gap > 0 else gap / pooled if pooled > 0 else 0.0
    return gaussian_epsilon(mu, delta)
