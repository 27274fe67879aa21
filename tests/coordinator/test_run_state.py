"""Tests for the run state: waiting, stalled, finished and stopped, on a fake clock."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from coordinator.engine.round_types import RoundRecord
from coordinator.engine.run_state import FIRST_SHOWN_S, REFRESH_S, RunState, all_skipped
from protocols.messages import MAX_LISTED_MISSING, MAX_STATUS_EVENTS, CoordinatorStatus
from protocols.transport.inprocess import InProcessBroker


class Clock:
    """Epoch seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[RunState, Clock, list[CoordinatorStatus]]:
    clock, sent = Clock(), []

    def publish(**fields: Any) -> None:  # as the engine does: every status must be valid
        sent.append(CoordinatorStatus(fleet="lab", **fields))

    return RunState(publish, clock=clock), clock, sent


def outstanding_of(missing: set[str]) -> Callable[[], set[str]]:
    return lambda: set(missing)


def test_a_quick_round_publishes_no_waiting_status() -> None:
    state, clock, sent = make()
    state.set("running")

    with state.waiting(outstanding_of({"d1"}), timeout_s=60):
        clock.now += FIRST_SHOWN_S / 2
        state.tick()

    assert [s.state for s in sent] == ["running"]


def test_a_wait_shows_who_is_missing_and_the_deadline_then_goes_back() -> None:
    state, clock, sent = make()
    state.set("running")
    missing = {"d3", "d1"}
    start = clock.now

    with state.waiting(lambda: set(missing), timeout_s=60):
        clock.now += FIRST_SHOWN_S
        state.tick()
        missing.discard("d1")
        clock.now += REFRESH_S / 2
        state.tick()  # not due: no status per message
        clock.now += REFRESH_S / 2
        state.tick()

    assert [s.state for s in sent] == ["running", "waiting", "waiting", "running"]
    assert (sent[1].missing, sent[1].missing_count, sent[1].deadline) == (
        ("d1", "d3"),
        2,
        start + 60,
    )
    assert sent[2].missing == ("d3",)
    assert (sent[3].missing, sent[3].deadline) == ((), None)


def test_no_answer_for_half_the_timeout_is_a_stall_with_an_event() -> None:
    state, clock, sent = make()
    state.set("running")

    with state.waiting(outstanding_of({"d2"}), timeout_s=20):
        for _ in range(4):
            clock.now += REFRESH_S
            state.tick()

    states = [s.state for s in sent]
    assert states == ["running", "waiting", "stalled", "stalled", "stalled", "running"]
    stalled = sent[2]
    assert stalled.missing == ("d2",)
    assert stalled.reason == "no answer for 10 s; waiting for 1 device(s)"
    assert [e.level for e in stalled.events] == ["warn"]
    assert len(sent[4].events) == 1  # one event per stall, not one per refresh


def test_an_answer_ends_a_stall() -> None:
    state, clock, sent = make()
    missing = {"d1", "d2"}

    with state.waiting(lambda: set(missing), timeout_s=10):
        clock.now += REFRESH_S
        state.tick()
        missing.discard("d1")
        clock.now += REFRESH_S
        state.tick()

    assert [s.state for s in sent[:2]] == ["stalled", "waiting"]


def test_missing_devices_are_named_up_to_the_limit_and_counted_in_full() -> None:
    state, clock, sent = make()
    many = {f"d{i:05d}" for i in range(MAX_LISTED_MISSING + 50)}

    with state.waiting(outstanding_of(many), timeout_s=600):
        clock.now += FIRST_SHOWN_S
        state.tick()

    assert len(sent[0].missing) == MAX_LISTED_MISSING
    assert sent[0].missing_count == MAX_LISTED_MISSING + 50
    assert sent[0].missing[0] == "d00000"


def test_short_of_devices_waits_then_stalls_after_half_its_time() -> None:
    state, clock, sent = make()
    deadline = clock.now + 60

    state.short_of_devices(3, 1, ["d2"], joined=False, deadline=deadline)
    state.short_of_devices(3, 1, ["d2"], joined=False, deadline=deadline)  # nothing new
    clock.now += 30
    state.short_of_devices(3, 1, ["d2"], joined=False, deadline=deadline)

    assert [s.state for s in sent] == ["waiting", "stalled"]
    assert sent[0].reason == "waiting for 3 device(s) to join: 1 online"
    assert (sent[0].missing, sent[0].deadline) == (("d2",), deadline)
    assert [e.text for e in sent[-1].events] == [f"stalled: {sent[0].reason}"]


def test_devices_gone_after_joining_are_waited_for_with_an_event_naming_them() -> None:
    state, clock, sent = make()
    state.set("running")

    state.short_of_devices(3, 2, ["d3"], joined=True, deadline=clock.now + 60)

    assert sent[-1].state == "waiting"
    assert sent[-1].reason == "waiting for 3 device(s) to come back: 2 online"
    assert (sent[-1].missing, sent[-1].missing_count) == (("d3",), 1)
    assert [e.level for e in sent[-1].events] == ["warn"]


def test_finish_is_finished_unless_the_run_stopped_early() -> None:
    state, _, sent = make()
    state.finish()
    assert (sent[-1].state, state.stop_reason) == ("finished", "")

    state.stopping("stopped after round 4: the privacy budget is spent")
    state.finish()
    assert (sent[-1].state, sent[-1].reason) == (
        "stopped",
        "stopped after round 4: the privacy budget is spent",
    )


def record(round_id: int, *, rejected: bool) -> RoundRecord:
    scalars = {"aggregate_rejected": 1.0} if rejected else {}
    return RoundRecord(round_id, 0, 2, math.nan, 0, 0, 0.0, scalars=scalars)


def test_a_run_whose_rounds_were_all_skipped_is_stopped() -> None:
    state, _, sent = make()

    state.finish(all_skipped([record(i, rejected=True) for i in (1, 2, 3)]))

    assert sent[-1].state == "stopped"
    assert sent[-1].reason == "all 3 round(s) were skipped: the model never changed"
    assert state.stop_reason == sent[-1].reason
    one_counted = [record(1, rejected=True), record(2, rejected=False)]
    assert all_skipped(one_counted) == all_skipped([]) == ""


def test_stop_publishes_at_once_with_an_error_event() -> None:
    state, clock, sent = make()

    state.stop("interrupted after round 2")

    assert (sent[-1].state, sent[-1].reason) == ("stopped", "interrupted after round 2")
    assert [(e.at, e.level) for e in sent[-1].events] == [(clock.now, "error")]


def test_events_are_bounded_and_info_waits_for_the_next_status() -> None:
    state, _, sent = make()
    state.set("running")
    state.event("info", "quiet")
    assert len(sent) == 1

    for i in range(MAX_STATUS_EVENTS + 5):
        state.event("warn", f"warning {i}")

    events = sent[-1].events
    assert len(events) == MAX_STATUS_EVENTS
    assert events[-1].text == f"warning {MAX_STATUS_EVENTS + 4}"


def test_a_wait_on_the_watched_transport_ticks_while_it_waits() -> None:
    # Arrange: a hub that delivers one message, then has nothing left: the wait ends unsettled
    state, clock, sent = make()
    hub = InProcessBroker()
    client = hub.connect("coordinator")
    client.subscribe("t", lambda _t, _p: setattr(clock, "now", clock.now + FIRST_SHOWN_S))
    client.publish("t", b"x")

    # Act
    with state.waiting(outstanding_of({"d9"}), timeout_s=60) as watch:
        settled = watch.transport(client).wait_until(lambda: False, 60)

    # Assert
    assert not settled
    assert [s.state for s in sent] == ["waiting", "online"]
    assert sent[0].missing == ("d9",)


@pytest.mark.parametrize("state_name", ["running", "waiting"])
def test_republish_sends_the_current_status_again(state_name: str) -> None:
    state, _, sent = make()
    state.set(state_name, reason="x")

    state.republish()

    assert sent[-1] == sent[-2].model_copy(update={"sent_at": sent[-1].sent_at})


def test_enough_devices_goes_back_to_the_state_before_the_shortfall() -> None:
    state, clock, sent = make()
    state.set("running")
    state.enough_devices()  # no shortfall: nothing sent
    assert len(sent) == 1

    state.short_of_devices(2, 1, ["d1"], joined=True, deadline=clock.now)
    state.short_of_devices(2, 1, ["d1"], joined=True, deadline=clock.now)
    state.enough_devices()

    assert [s.state for s in sent] == ["running", "stalled", "running"]
    assert sent[-1].missing == ()
