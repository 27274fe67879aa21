"""serve's pause between retries of a failed round: quick failures wait, slow ones do not."""

from __future__ import annotations

import pytest

from coordinator.run.serve import retry_pause_s


@pytest.mark.parametrize(
    ("attempt", "elapsed_s", "expected_s"),
    [
        (1, 0.2, 4.8),  # everybody declined at once: the first retry waits out 5 s
        (2, 0.0, 10.0),
        (3, 1.0, 19.0),
        (3, 25.0, 0.0),  # the attempt already waited longer (e.g. for its deadline)
        (10, 0.0, 60.0),  # never more than the round's deadline
    ],
)
def test_a_failed_round_is_retried_after_a_doubling_pause(
    attempt: int, elapsed_s: float, expected_s: float
) -> None:
    assert retry_pause_s(attempt, elapsed_s, round_timeout_s=60.0) == pytest.approx(expected_s)
