"""The appliance↔hub wire: its JSON Schema is kept in protocol_schema.json beside this
file, so every change to a message shows in review as a change to that file. After a
deliberate change, write it again with `KVL_WRITE_PROTOCOL_SCHEMA=1 pytest THIS_FILE`
(and move PROTOCOL_VERSION when an older peer could not read the new message)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared import protocol

SNAPSHOT = Path(__file__).with_name("protocol_schema.json")


def test_the_wire_schema_is_the_reviewed_one() -> None:
    current = json.dumps(protocol.json_schema(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("KVL_WRITE_PROTOCOL_SCHEMA") == "1":
        SNAPSHOT.write_text(current)
    assert SNAPSHOT.read_text() == current, (
        "the protocol changed: review the change, then write the snapshot again "
        "(KVL_WRITE_PROTOCOL_SCHEMA=1)"
    )


def test_versions_outside_the_window_are_named() -> None:
    assert protocol.supported(protocol.PROTOCOL_VERSION)
    assert protocol.supported(protocol.OLDEST_NODE_PROTOCOL)
    for header in (None, "", "1", "x", "2.0", "-2", "9" * 40, str(protocol.PROTOCOL_VERSION + 1)):
        assert not protocol.supported(protocol.node_protocol(header)), header


@pytest.mark.parametrize(
    "capacity",
    [
        {"cpu_percent": float("inf")},
        {"cpu_percent": float("nan")},
        {"cpu_percent": 101},
        {"queue_waiting": -1},
        {"memory_total_mib": 10**300},
        {"memory_total_mib": 100, "memory_available_mib": 101},
        {"gpus": [{"name": "g", "memory_total_mib": 10, "memory_free_mib": 11}]},
        {"models": ["a@1"] * 2},
        {"models": [f"m{i}@1" for i in range(65)]},
        {"placement_errors": {"m": "\x00"}},
        {"extra": True},
    ],
)
def test_a_capacity_cannot_say_the_impossible(capacity: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        protocol.Capacity.model_validate(capacity)


def test_what_an_honest_node_sends_round_trips() -> None:
    beat = protocol.HeartbeatRequest(
        versions={"kvl": "0.1.0"},
        capacity=protocol.Capacity(
            cpu_percent=12.5,
            cpu_count=8,
            memory_total_mib=32_000,
            memory_available_mib=16_000,
            models=["gemma-3-270m@1.0.0"],
            gpus=[protocol.Gpu(name="CUDA0", memory_total_mib=80_000, memory_free_mib=70_000)],
            api=protocol.LanApi(port=8080),
            offload=True,
        ),
    )
    assert protocol.HeartbeatRequest.model_validate_json(beat.model_dump_json()) == beat
    events = protocol.EVENTS.validate_python(
        [
            {"id": "e1", "kind": "usage", "body": {"account": "acme", "tokens_in": 3}},
            {"id": "e2", "kind": "package_removed", "body": {"id": "p", "version": "v"}},
        ]
    )
    request = protocol.EventsRequest(events=events)
    assert protocol.EventsRequest.model_validate_json(request.model_dump_json()) == request
    with pytest.raises(ValidationError, match="twice"):
        protocol.EventsRequest(events=[events[0], events[0]])
    with pytest.raises(ValidationError, match="twice"):
        protocol.LeaseRequest(accounts=["a", "a"])


def test_an_older_node_is_answered_without_the_fields_its_version_does_not_know() -> None:
    """A node of protocol 2 forbids fields it does not know: the hub leaves out what
    version 3 added (ADDED_IN), and gives a version-3 node all of it."""
    answer = protocol.HeartbeatAnswer(
        node_id="n", received_at=1.0, desired_serial=3, trust_digest="sha256:ab",
        renew_certificate=True,
    )  # fmt: skip
    assert json.loads(protocol.dump_for(answer, 2)) == {
        "node_id": "n", "received_at": 1.0, "desired_serial": 3,
    }  # fmt: skip
    assert json.loads(protocol.dump_for(answer, 3))["trust_digest"] == "sha256:ab"
    for message, added in protocol.ADDED_IN.items():
        assert set(added) <= set(message.model_fields), message.__name__
        assert all(2 < v <= protocol.PROTOCOL_VERSION for v in added.values())


def test_a_desired_state_for_an_older_node_leaves_out_what_its_models_do_not_know() -> None:
    """A placed model's preset (protocol 7) is left out for a node of protocol 6, which
    would refuse the whole state for a field it does not know."""
    model = protocol.PlacedModel(
        name="m", version="1", sha256="a" * 64, size_bytes=1, format="gguf",
        preset=protocol.ModelPreset(n_ctx=1024, aliases=["gpt-4o-mini"]),
    )  # fmt: skip
    state = protocol.DesiredState(node_id="n", serial=1, accounts=[], keys=[], models=[model])
    old = json.loads(protocol.dump_for(state, 6))
    assert "preset" not in old["models"][0]
    assert protocol.DesiredState.model_validate(old).models[0].name == "m"
    new = protocol.DesiredState.model_validate_json(protocol.dump_for(state, 7))
    assert new.models[0].preset == model.preset


def test_a_preset_is_bounded() -> None:
    for wrong in ({"n_ctx": 10}, {"kv_type": "q2_k"}, {"aliases": ["a", "a"]},
                  {"aliases": ["has@at"]}, {"stop": ["x"] * 5}, {"tool_format": "xml"},
                  {"system_prompt": "x" * 8001}, {"temperature": 3}):  # fmt: skip
        with pytest.raises(ValidationError):
            protocol.ModelPreset.model_validate(wrong)
