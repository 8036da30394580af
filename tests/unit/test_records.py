"""The one serializer of the records ranks exchange, and the names they carry as types."""

import json

import pytest

from orchestrator.protocol import records
from orchestrator.errors import Culprit, FailureKind
from orchestrator.node import placement
from orchestrator.protocol.wire import TERMINAL_STATES, HeartbeatState
from orchestrator.protocol.lease import Lease


def roundtrip(record):
    return records.from_dict(json.loads(json.dumps(records.to_dict(record))), type(record))


def test_records_survive_json_unchanged():
    lease = Lease(3, "a000003-abcdef", "n0", 12, 1700000000.5)
    culprit = Culprit(2, "n2", 4, "10:train", FailureKind.ERROR, "boom", {"program": "trainer", "kind": "TrainerError"})
    p = placement.resolve(num_nodes=2, gpus_per_node=4, train_mapping="0-3", rollout_mapping="4-7", gpus_per_engine=2, engine_port=8000)
    for record in (lease, culprit, p):
        assert roundtrip(record) == record


def test_the_file_format_is_plain_json_values():
    d = records.to_dict(Culprit(1, "h", None, None, FailureKind.DEAD, "x"))
    assert d == {"rank": 1, "host": "h", "iteration": None, "phase": None, "kind": "dead", "error": "x", "child": None}
    assert json.dumps({"state": HeartbeatState.DONE}) == '{"state": "done"}'
    assert "done" in TERMINAL_STATES and "waiting" not in TERMINAL_STATES


def test_a_record_that_does_not_fit_names_the_field():
    with pytest.raises(ValueError, match="Lease record.*pid"):
        records.from_dict({"generation": 1, "attempt": "a", "host": "h", "pid": "12", "pid_start": None}, Lease)
    with pytest.raises(ValueError, match="Culprit record.*host"):
        records.from_dict({"rank": 1}, Culprit)


def test_a_failure_kind_no_reader_knows_is_refused_where_it_is_made():
    assert Culprit(1, "h", None, None, "deadline", "x").kind is FailureKind.DEADLINE
    with pytest.raises(ValueError):
        Culprit(1, "h", None, None, "exploded", "x")
