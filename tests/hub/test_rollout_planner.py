"""The staged rollout planner, pure: which wave each node is in, and what each round does
from what the nodes report (hub/planning/rollout.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from hub.planning.rollout import (
    Candidate,
    Member,
    Rollback,
    Seen,
    Strategy,
    assign_waves,
    rollback,
    step,
)

if TYPE_CHECKING:
    from hub.planning.rollout import MemberState

NODES = [Candidate(f"id{i}", f"n{i}", "north" if i % 2 else "south") for i in range(1, 11)]


def test_waves_by_share_fill_the_fleet_in_name_order_after_the_canary() -> None:
    waves = assign_waves(Strategy(canary=1, waves=(30.0, 60.0, 100.0)), NODES)
    by_wave: dict[int, list[str]] = {}
    for c in sorted(NODES, key=lambda c: c.name):
        by_wave.setdefault(waves[c.id], []).append(c.name)
    # n1 the canary; 30 % of 10 nodes is 3 (the canary counts), 60 % is 6, the rest last.
    assert by_wave == {
        0: ["n1"],
        1: ["n10", "n2"],
        2: ["n3", "n4", "n5"],
        3: ["n6", "n7", "n8", "n9"],
    }


def test_waves_by_site_and_named_canaries() -> None:
    strategy = Strategy(canary_nodes=("n4", "id7"), sites=(("south",),))
    waves = assign_waves(strategy, NODES)
    assert {c.name for c in NODES if waves[c.id] == 0} == {"n4", "n7"}
    assert all(waves[c.id] == 1 for c in NODES if c.site == "south" and c.name != "n4")
    assert all(waves[c.id] == 2 for c in NODES if c.site == "north" and c.name != "n7")


def test_shares_short_of_the_whole_fleet_still_reach_every_node() -> None:
    waves = assign_waves(Strategy(canary=0, waves=(10.0, 20.0)), NODES)
    assert sorted(waves.values()).count(2) == 9  # 10 % of 10 nodes in wave 1, the rest after
    assert set(waves) == {c.id for c in NODES}


def _members(waves: dict[str, int]) -> list[Member]:
    names = {c.id: c.name for c in NODES}
    return [Member(node_id, names[node_id], wave) for node_id, wave in waves.items()]


def _run(
    strategy: Strategy,
    members: list[Member],
    seen: dict[str, Seen],
    *,
    wave: int = 0,
    now: float = 100.0,
) -> tuple[list[Member], int, bool, str | None]:
    result = step(strategy, members, seen, wave=wave, wave_started_at=0.0, now=now)
    return result.members, result.wave, result.done, result.halted


def test_a_wave_reaches_at_most_max_unavailable_nodes_and_waits_for_the_soak() -> None:
    strategy = Strategy(canary=1, waves=(100.0,), soak_s=60.0, max_unavailable=2)
    members = _members(assign_waves(strategy, NODES[:5]))
    members, wave, _, _ = _run(strategy, members, {})
    assert [m.name for m in members if m.state == "targeted"] == ["n1"]
    # The canary healthy: its soak starts; not yet over, so the wave stays.
    healthy = {"id1": Seen("healthy", last_seen=100.0)}
    members, wave, _, _ = _run(strategy, members, healthy, now=110.0)
    assert (wave, next(m for m in members if m.name == "n1").healthy_since) == (0, 110.0)
    # A heartbeat that is not healthy starts the soak over.
    members, wave, _, _ = _run(strategy, members, {"id1": Seen("pending", last_seen=120.0)},
                               now=120.0)  # fmt: skip
    assert next(m for m in members if m.name == "n1").healthy_since is None
    members, wave, _, _ = _run(strategy, members, {"id1": Seen("healthy", last_seen=130.0)},
                               now=130.0)  # fmt: skip
    members, wave, done, _ = _run(strategy, members, {"id1": Seen("healthy", last_seen=190.0)},
                                  now=190.0)  # fmt: skip
    # Soaked: the next wave begins at once, two of its nodes at a time.
    assert (wave, done) == (1, False)
    assert sorted(m.name for m in members if m.state == "targeted") == ["n2", "n3"]
    ids = [m.node_id for m in members]

    def every(at: float) -> dict[str, Seen]:
        return {node_id: Seen("healthy", last_seen=at) for node_id in ids}

    members, _, done, _ = _run(strategy, members, every(300.0), wave=1, now=300.0)
    members, _, done, _ = _run(strategy, members, every(400.0), wave=1, now=400.0)
    assert sorted(m.name for m in members if m.state == "targeted") == ["n4", "n5"]
    members, _, done, _ = _run(strategy, members, every(500.0), wave=1, now=500.0)
    members, _, done, _ = _run(strategy, members, every(600.0), wave=1, now=600.0)
    assert done
    assert all(m.state == "updated" for m in members)


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        (Seen("failed", "the signature does not verify", 99.0), "failed to update"),
        (Seen("rolled-back", "booted the previous image", 99.0), "rolled back"),
        (Seen("pending", last_seen=10.0), "offline"),
        (Seen("pending", last_seen=99.0, burn_rate=40.0), "burns its error budget 40.0x"),
    ],
)
def test_a_failing_node_halts_the_rollout_and_no_node_more_is_reached(seen: Seen, why: str) -> None:
    strategy = Strategy(canary=1, offline_after_s=60.0, max_burn_rate=14.4)
    members = _members(assign_waves(strategy, NODES[:3]))
    members, _, _, _ = _run(strategy, members, {}, now=50.0)
    members, wave, done, halted = _run(strategy, members, {"id1": seen})
    assert halted is not None
    assert halted.startswith("node n1: ")
    assert why in halted
    assert (wave, done) == (0, False)
    assert [m.state for m in sorted(members, key=lambda m: m.name)] == [
        "failed", "waiting", "waiting"]  # fmt: skip


def test_a_slow_burn_or_an_updated_node_gone_quiet_does_not_halt() -> None:
    strategy = Strategy(canary=1, soak_s=0.0, offline_after_s=60.0, max_burn_rate=14.4)
    members = _members(assign_waves(strategy, NODES[:3]))
    members, _, _, _ = _run(strategy, members, {}, now=0.0)
    members, wave, _, halted = _run(
        strategy, members, {"id1": Seen("healthy", last_seen=10.0, burn_rate=2.0)}, now=10.0
    )
    assert (wave, halted) == (1, None)
    # The canary, updated, unheard since: only the current wave's silence halts.
    members, wave, _, halted = _run(strategy, members, {}, wave=1, now=500.0)
    assert halted is not None
    assert "n2" in halted  # the wave's own node, never heard since it was reached
    assert next(m for m in members if m.name == "n1").state == "updated"


def test_a_member_that_left_is_skipped_and_the_abort_waits_for_the_rest() -> None:
    strategy = Strategy(canary=1, soak_s=0.0)
    members = _members(assign_waves(strategy, NODES[:2]))
    gone = {"id1": Seen("gone"), "id2": Seen("healthy", last_seen=1.0)}
    members, _, _, _ = _run(strategy, members, {}, now=1.0)
    members, wave, done, halted = _run(strategy, members, gone, now=1.0)
    assert [m.state for m in members] == ["skipped", "targeted"]
    assert (wave, done, halted) == (1, False, None)
    assert not _back(members, {"id2": Seen("pending", last_seen=1.0)}, now=2.0).done
    assert _back(members, {"id2": Seen("healthy", last_seen=1.0)}, now=2.0).done
    assert _back([replace(m, state="waiting") for m in members], {}, now=2.0).done


def _back(
    members: list[Member], seen: dict[str, Seen], *, now: float, finished_by: str | None = None
) -> Rollback:
    return rollback(members, seen, now=now, offline_after_s=120.0, finished_by=finished_by)


def _reached(states: dict[str, MemberState]) -> list[Member]:
    """Members of an aborted rollout by name (n1, n2, …), in the states given."""
    return [
        Member(f"id{name[1:]}", name, 0, state, targeted_at=0.0) for name, state in states.items()
    ]


def test_a_rollback_stops_waiting_for_a_node_offline_past_the_fleets_window() -> None:
    members = _reached({"n1": "updated", "n2": "targeted", "n3": "waiting"})
    back_home = Seen("healthy", last_seen=100.0)
    silent = Seen("pending", last_seen=100.0)
    # Heard 119 s ago, with a 120 s window: online still, so the rollback waits for it.
    waiting = _back(members, {"id1": back_home, "id2": silent}, now=219.0)
    assert (waiting.done, waiting.unconfirmed) == (False, [])
    assert [m.state for m in waiting.members] == ["updated", "targeted", "waiting"]
    # At 120 s the fleet calls it offline (`node_status`): the rollback is done without it,
    # and it is recorded as never having confirmed; the node back home and the one never
    # reached are left as they were.
    done = _back(members, {"id1": back_home, "id2": silent}, now=220.0)
    assert (done.done, done.unconfirmed) == (True, ["n2"])
    by_name = {m.name: m for m in done.members}
    assert [by_name[n].state for n in ("n1", "n2", "n3")] == ["updated", "unconfirmed", "waiting"]
    assert by_name["n2"].note == "never confirmed: offline, not heard for 120 s"
    # A node never heard at all is offline too (never within the window).
    never = _back(members, {"id1": back_home, "id2": Seen("pending")}, now=1.0)
    assert never.unconfirmed == ["n2"]
    assert never.members[1].note == "never confirmed: offline, never heard"


def test_the_operators_finish_ends_a_rollback_whatever_the_nodes_report() -> None:
    members = _reached({"n1": "updated", "n2": "failed", "n3": "targeted", "n4": "skipped"})
    members[1] = replace(members[1], note="rolled back: booted the previous image")
    seen = {
        "id1": Seen("healthy", last_seen=99.0),
        "id2": Seen("failed", "no space left", last_seen=99.0),
        "id3": Seen("pending", last_seen=99.0),  # heard, but running the aborted target
    }
    assert not _back(members, seen, now=100.0).done
    done = _back(members, seen, now=100.0, finished_by="ops")
    assert (done.done, done.unconfirmed) == (True, ["n2", "n3"])
    notes = {m.name: (m.state, m.note) for m in done.members}
    assert notes == {
        "n1": ("updated", ""),
        "n2": ("unconfirmed", (
            "never confirmed: the rollback was finished by ops (failed: no space left); "
            "before: rolled back: booted the previous image")),
        "n3": ("unconfirmed", "never confirmed: the rollback was finished by ops"),
        "n4": ("skipped", ""),
    }  # fmt: skip
