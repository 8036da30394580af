"""Checkpoint retention (checkpoints/retention.py): the pure keep/remove decision, consumer markers,
removal by rename-then-delete, and the `checkpoint.*` keys."""

import logging
import os
from pathlib import Path

import pytest

from orchestrator import config
from orchestrator.config import RunConfig
from orchestrator.checkpoints import retention, store
from orchestrator.errors import ConfigError
from orchestrator.phase_table import RLPhase
from orchestrator.protocol import faults, fsio
from orchestrator.protocol.layout import RunLayout, checkpoint_iteration

BASE = Path("/nonexistent/base-model")  # no current pointer: the policy is the base model, which is never pruned

log = logging.getLogger("test")


@pytest.mark.parametrize("present,current,keep_last,keep_every,consumers,kept", [
    (range(1, 13), 12, 3, 0, {}, [10, 11, 12]),
    (range(1, 13), 12, 2, 5, {}, [5, 10, 11, 12]),
    (range(1, 13), 12, 1, 0, {}, [12]),
    (range(1, 13), 12, 1, 0, {2: ["r00001.json"]}, [2, 12]),
    (range(1, 13), 12, 20, 0, {}, list(range(1, 13))),
    ([1, 2, 3, 7, 8], 7, 2, 0, {}, [3, 7, 8]),  # 8 is newer than current: kept; the last 2 up to current are 3 and 7
    ([1, 2, 3], 4, 2, 0, {}, [2, 3]),  # current not listed yet (a lagging listing): still only keeps more
    ([], 4, 3, 0, {}, []),
])
def test_decision_keeps_current_newest_every_nth_and_marked(present, current, keep_last, keep_every, consumers, kept):
    decision = retention.decide(present, current, keep_last, keep_every, consumers)
    assert sorted(decision.keep) == kept
    assert decision.remove == sorted(set(present) - set(kept))


def test_decision_says_why_each_checkpoint_is_kept():
    decision = retention.decide(range(1, 11), 10, 2, 5, {5: ["r00002.json"]})
    assert decision.keep == {5: ["keep_every=5", "consumer r00002.json"], 9: ["keep_last=2"],
                             10: ["current", "keep_last=2", "keep_every=5"]}


def _run_with_checkpoints(root: Path, iterations, current: int) -> RunLayout:
    layout = RunLayout(root)
    for i in iterations:
        layout.checkpoint(i).mkdir(parents=True)
        fsio.write_record(layout.checkpoint(i) / "marker.json", {"iteration": i})
    fsio.write_record(layout.current_checkpoint, {"iteration": current, "path": f"checkpoints/{layout.checkpoint(current).name}"})
    return layout


def _left(layout: RunLayout) -> list[str]:
    return sorted(os.listdir(layout.checkpoints))


def test_prune_renames_aside_before_it_deletes(tmp_path):
    layout = _run_with_checkpoints(tmp_path, range(1, 6), 5)
    seen = []

    def before_delete(trash: Path) -> None:
        checkpoints = [n for n in _left(layout) if checkpoint_iteration(n) is not None]
        seen.append((trash.name.rsplit(".", 1)[0], (trash / "marker.json").is_file(), checkpoints))

    assert retention.prune(layout, store.current(layout, BASE), 3, 0, log, before_delete=before_delete) == [1, 2]
    assert seen == [(".trash-iter-000001", True, ["iter-000002", "iter-000003", "iter-000004", "iter-000005"]),
                    (".trash-iter-000002", True, ["iter-000003", "iter-000004", "iter-000005"])]
    assert _left(layout) == ["current.json", "iter-000003", "iter-000004", "iter-000005"]


def test_prune_deletes_what_a_cut_short_removal_left(tmp_path):
    layout = _run_with_checkpoints(tmp_path, range(3, 6), 5)
    leftover = layout.checkpoint_trash(2, "0123abcd")
    (leftover / "optimizer").mkdir(parents=True)
    (leftover / "optimizer" / "adamw.safetensors").write_bytes(b"x" * 100)
    assert retention.prune(layout, store.current(layout, BASE), 3, 0, log) == []
    assert _left(layout) == ["current.json", "iter-000003", "iter-000004", "iter-000005"]


def test_a_consumer_marker_keeps_its_checkpoint_until_the_consumer_moves_on(tmp_path):
    layout = _run_with_checkpoints(tmp_path, range(1, 6), 5)
    retention.mark_consumer(layout, 1, layout.checkpoint(2))
    retention.mark_consumer(layout, 0, tmp_path / "data" / "model")  # the base model: not a checkpoint, pins nothing
    assert retention.prune(layout, store.current(layout, BASE), 1, 0, log, ranks=2) == [1, 3, 4]
    assert _left(layout) == ["consumers", "current.json", "iter-000002", "iter-000005"]
    retention.mark_consumer(layout, 1, layout.checkpoint(5))
    assert retention.prune(layout, store.current(layout, BASE), 1, 0, log, ranks=2) == [2]


def test_a_marker_outside_the_ranks_counts_too(tmp_path):
    """An outside reader (an evaluation job) writes its own marker under a number no rank has."""
    layout = _run_with_checkpoints(tmp_path, range(1, 6), 5)
    retention.mark_consumer(layout, 1000, layout.checkpoint(3))
    assert retention.prune(layout, store.current(layout, BASE), 1, 0, log, ranks=2) == [1, 2, 4]


def test_a_marker_that_does_not_validate_stops_every_removal(tmp_path):
    layout = _run_with_checkpoints(tmp_path, range(1, 6), 5)
    marker = layout.checkpoint_consumer(1)
    marker.parent.mkdir(parents=True)
    marker.write_bytes(b'{"sha256":"00","body":{"checkpoint":"checkpoints/iter-0000')  # cut short
    assert retention.prune(layout, store.current(layout, BASE), 1, 0, log, ranks=2) == []
    assert len(_left(layout)) == 7
    marker.unlink()
    assert retention.prune(layout, store.current(layout, BASE), 1, 0, log, ranks=2) == [1, 2, 3, 4]


def test_without_a_current_checkpoint_nothing_is_removed(tmp_path):
    layout = _run_with_checkpoints(tmp_path, range(1, 6), 5)
    layout.current_checkpoint.unlink()
    assert retention.prune(layout, store.current(layout, BASE), 1, 0, log) == []
    assert retention.prune(RunLayout(tmp_path / "empty"), store.current(RunLayout(tmp_path / "empty"), BASE), 1, 0, log) == []


def test_mark_consumer_writes_only_when_the_checkpoint_changes(tmp_path):
    layout = RunLayout(tmp_path)
    retention.mark_consumer(layout, 2, layout.checkpoint(4))
    marker = layout.checkpoint_consumer(2)
    body = fsio.read_record(marker)
    assert (body["rank"], body["checkpoint"], body["pid"]) == (2, "checkpoints/iter-000004", os.getpid())
    written = marker.stat().st_mtime_ns, marker.stat().st_ino
    retention.mark_consumer(layout, 2, layout.checkpoint(4))
    assert (marker.stat().st_mtime_ns, marker.stat().st_ino) == written
    retention.mark_consumer(layout, 2, layout.checkpoint(5))
    assert fsio.read_record(marker)["checkpoint"] == "checkpoints/iter-000005"


def test_checkpoint_names_parse_and_trash_is_not_a_checkpoint(tmp_path):
    layout = RunLayout(tmp_path)
    assert checkpoint_iteration(layout.checkpoint(7).name) == 7
    assert checkpoint_iteration(layout.checkpoint(1234567).name) == 1234567
    assert checkpoint_iteration(layout.checkpoint_trash(7, "ab").name) is None
    assert checkpoint_iteration(".iter-000007.a000001-abcdef.tmp") is None
    assert checkpoint_iteration("current.json") is None


def test_the_staging_directories_of_an_iteration_are_every_try_of_it_and_nothing_else(tmp_path):
    layout = RunLayout(tmp_path)
    tries = [layout.checkpoint_staging(7, "a000001-abcdef"), layout.checkpoint_staging(7, "a000002-012345", 1)]
    others = [layout.checkpoint(7), layout.checkpoint_staging(17, "a000001-abcdef"), layout.checkpoint_trash(7, "ab"),
              layout.checkpoint_staging(70, "a000001-abcdef")]
    for d in tries + others:
        d.mkdir(parents=True)
    assert layout.checkpoint_stagings(7) == sorted(tries)
    assert layout.checkpoint_stagings(8) == []


def test_the_removal_hold_is_a_known_fault():
    assert faults.from_env({faults.ENV: "hold-in-removal@6:13"}) == faults.Fault("hold-in-removal", 6, 13)


@pytest.mark.parametrize("override,message", [
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be at least 1"),
    ("checkpoint.keep_every=-5", "checkpoint.keep_every must be >= 0"),
    ("checkpoint.keep_last=two", "checkpoint.keep_last='two': expected a value of type int"),
])
def test_bad_retention_keys_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        config.build_sections(config.parse_overrides([override]))


def test_retention_keys_default_and_stay_out_of_the_fingerprint(tmp_path):
    """Only the master prunes: ranks with other values still join, and a rerun may change them."""
    def run(**keys) -> RunConfig:
        return RunConfig(data_path=tmp_path, log_path=tmp_path / "run", rl_phase=RLPhase.BOTH, eval_interval=1, rank=0,
                         checkpoint=config.CheckpointConfig(**keys))

    assert (run().checkpoint.keep_last, run().checkpoint.keep_every) == (3, 0)
    assert run(keep_last=1, keep_every=10).fingerprint() == run().fingerprint()
    assert {"checkpoint.keep_last", "checkpoint.keep_every"} <= set(config.valid_override_keys())
