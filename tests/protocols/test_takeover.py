"""Giving up a client id another client keeps taking, and only then."""

from __future__ import annotations

from protocols.transport.takeover import SESSION_TAKEN_OVER, TakeoverWatch


def _cycle(watch: TakeoverWatch, now: list[float], lasted: float, *, session: bool) -> str | None:
    """A connection that lasted `lasted` s is lost (the verdict), then the next one is made."""
    now[0] += lasted
    verdict = watch.disconnected(128)  # MQTT 3.1.1 gives no reason ("Unspecified error")
    if verdict is None:
        watch.connected(session_present=session)
    return verdict


def test_three_short_lived_connections_in_a_row_give_up_with_the_likely_cause() -> None:
    now = [0.0]
    watch = TakeoverWatch("dev-1", max_takeovers=3, short_lived_s=10.0, clock=lambda: now[0])
    watch.connected(session_present=False)
    verdicts = [_cycle(watch, now, 1.5, session=True) for _ in range(3)]
    assert verdicts[:2] == [None, None]
    assert verdicts[2] is not None
    assert "--device-id dev-1" in verdicts[2]
    assert "3 times in a row" in verdicts[2]


def test_long_connections_lost_sessions_and_failed_attempts_reset_the_count() -> None:
    now = [0.0]
    watch = TakeoverWatch("dev-1", max_takeovers=3, short_lived_s=10.0, clock=lambda: now[0])
    watch.connected(session_present=False)
    assert _cycle(watch, now, 1.0, session=True) is None
    assert _cycle(watch, now, 60.0, session=True) is None  # a normal drop after a minute
    assert watch.count == 0
    assert _cycle(watch, now, 1.0, session=True) is None
    assert _cycle(watch, now, 1.0, session=False) is None  # a restarted broker lost the session
    assert watch.count == 0
    assert _cycle(watch, now, 1.0, session=True) is None
    now[0] += 1.0
    watch.disconnected(128)
    watch.connect_failed()  # the broker was away: nobody took the session
    watch.connected(session_present=True)
    assert watch.count == 0


def test_mqtt5_session_taken_over_counts_however_long_the_connection_lasted() -> None:
    now = [0.0]
    watch = TakeoverWatch("dev-1", max_takeovers=2, clock=lambda: now[0])
    verdict = None
    for _ in range(2):
        watch.connected(session_present=True)
        now[0] += 3600
        verdict = watch.disconnected(SESSION_TAKEN_OVER)
    assert verdict is not None
    assert "handed its session to another connection" in verdict


def test_zero_never_gives_up() -> None:
    now = [0.0]
    watch = TakeoverWatch("dev-1", max_takeovers=0, clock=lambda: now[0])
    watch.connected(session_present=True)
    for _ in range(50):
        assert watch.disconnected(SESSION_TAKEN_OVER) is None
        assert _cycle(watch, now, 0.5, session=True) is None
