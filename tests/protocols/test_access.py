"""The grants both brokers apply, and the embedded broker's per-run account checks."""

from __future__ import annotations

from protocols import access, topics
from protocols.access import COORDINATOR_USER, DASHBOARD_USER, OPERATOR_USER, VIEWER_USER
from protocols.transport.run_access import DEVICE_USER, RunAccess, coordinator_client_id

FLEET = "lab"


def test_a_device_writes_a_fixed_list_of_names_and_reads_only_its_own_and_the_coordinators() -> (
    None
):
    grants = access.device_grants(FLEET, "dev-1", max_chunks=3)
    update = topics.device(FLEET, "dev-1", "update")
    assert access.allows(grants, update, write=True)
    assert access.allows(grants, topics.chunk_topic(update, 2), write=True)
    assert not access.allows(grants, topics.chunk_topic(update, 3), write=True)
    assert not access.allows(
        grants, topics.chunk_topic(topics.device(FLEET, "dev-1", "hello"), 0), write=True
    )
    assert not access.allows(grants, f"{topics.device(FLEET, 'dev-1', 'status')}/x", write=True)
    assert not access.allows(grants, topics.device(FLEET, "dev-2", "update"), write=True)
    assert not access.allows(grants, topics.command(FLEET), write=True)
    assert access.allows(grants, topics.command(FLEET), write=False)
    assert access.allows(grants, topics.chunk_subscription(topics.shared_model(FLEET)), write=False)
    for wildcard in ("#", topics.fleet_subtree(FLEET), topics.device_subscription(FLEET, "update")):
        assert not access.allows(grants, wildcard, write=False), wildcard
    # the fleet status: the summary readable, no row writable (not even its own) or readable
    assert access.allows(grants, topics.fleet_status(FLEET), write=False)
    for row in (topics.fleet_row(FLEET, "dev-1"), topics.fleet_row(FLEET, "dev-2")):
        assert not access.allows(grants, row, write=True), row
        assert not access.allows(grants, row, write=False), row
    assert not access.allows(grants, topics.fleet_row(FLEET), write=False)


def test_the_chunk_limit_covers_the_largest_upload() -> None:
    assert access.chunk_limit(1000, 168) == 10  # 100 data bytes per chunk after the header
    assert access.chunk_limit(1001, 168) == 11
    assert access.chunk_limit(0, 168) == 1


def test_run_accounts_bind_client_ids_and_refuse_wrong_passwords() -> None:
    run = RunAccess.generate(FLEET)
    coordinator, device = run.passwords[COORDINATOR_USER], run.passwords[DEVICE_USER]
    assert len({coordinator, device, run.passwords[OPERATOR_USER]}) == 3
    assert run.refusal(COORDINATOR_USER, coordinator, coordinator_client_id(FLEET)) is None
    assert run.refusal(DEVICE_USER, device, "dev-1") is None
    assert run.refusal(OPERATOR_USER, run.passwords[OPERATOR_USER], "pfl-operator-x-1") is None
    assert run.refusal(VIEWER_USER, run.passwords[VIEWER_USER], "pfl-viewer-status-1") is None
    refused = [
        (None, None, "dev-1"),
        ("nobody", device, "dev-1"),
        (DEVICE_USER, coordinator, "dev-1"),
        (DEVICE_USER, device, coordinator_client_id(FLEET)),
        (DEVICE_USER, device, "all"),
        (OPERATOR_USER, run.passwords[OPERATOR_USER], coordinator_client_id(FLEET)),
        (OPERATOR_USER, run.passwords[OPERATOR_USER], "pfl-status-1"),
        (VIEWER_USER, run.passwords[VIEWER_USER], "pfl-operator-export-1"),  # not its session
        (DASHBOARD_USER, run.passwords[DASHBOARD_USER], "pfl-viewer-status-1"),
        (COORDINATOR_USER, coordinator, "dev-1"),
    ]
    for username, password, client_id in refused:
        assert run.refusal(username, password, client_id) is not None, (username, client_id)
    assert RunAccess.generate(FLEET).passwords[DEVICE_USER] != device  # new on every run


def test_run_accounts_apply_each_roles_grants_to_its_client_id() -> None:
    run = RunAccess.generate(FLEET)
    own = topics.device(FLEET, "dev-1", "update")
    assert run.allows(DEVICE_USER, "dev-1", own, write=True)
    assert not run.allows(DEVICE_USER, "dev-2", own, write=True)
    assert not run.allows(DEVICE_USER, "dev-1", topics.command(FLEET), write=True)
    assert run.allows(OPERATOR_USER, "pfl-operator-1", topics.command(FLEET), write=True)
    assert not run.allows(
        OPERATOR_USER, "pfl-operator-1", topics.device_subscription(FLEET, "update"), write=False
    )
    assert run.allows(
        COORDINATOR_USER, coordinator_client_id(FLEET), topics.fleet_subtree(FLEET), write=False
    )
    assert not run.allows(None, "dev-1", own, write=True)
    assert not run.allows(DEVICE_USER, "dev-1", topics.fleet_row(FLEET, "dev-1"), write=True)


def test_viewer_accounts_read_statuses_and_write_nothing() -> None:
    run = RunAccess.generate(FLEET)
    for user in (VIEWER_USER, DASHBOARD_USER):
        grants = access.tool_grants(user, FLEET)
        client_id = f"{user}-1"
        for readable in (
            topics.coordinator_status(FLEET),
            topics.fleet_status(FLEET),
            topics.fleet_row(FLEET),
            topics.fleet_row(FLEET, "dev-1"),
            topics.run_history(FLEET),
            topics.device_subscription(FLEET, "status"),
        ):
            assert access.allows(grants, readable, write=False), readable
            assert run.allows(user, client_id, readable, write=False), readable
        for forbidden in (
            topics.command(FLEET),
            topics.command(FLEET, "dev-1"),
            topics.shared_model(FLEET),
            topics.round_announcement(FLEET),
            topics.coordinator_status(FLEET),
            topics.fleet_row(FLEET, "dev-1"),
        ):
            assert not access.allows(grants, forbidden, write=True), forbidden
            assert not run.allows(user, client_id, forbidden, write=True), forbidden
        for secret in (
            topics.shared_model(FLEET),
            topics.device_subscription(FLEET, "update"),
            topics.device_subscription(FLEET, "export-report"),
        ):
            assert not access.allows(grants, secret, write=False), secret
