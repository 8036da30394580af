"""metrics.jsonl survives a master killed mid-line: the next append cuts the torn tail,
keeps every complete line, and never writes an iteration twice."""

import json

from orchestrator.data import summary
from orchestrator.protocol.layout import RunLayout


def _lines(layout: RunLayout) -> list[dict]:
    return [json.loads(line) for line in layout.metrics.read_text().splitlines()]


def test_an_append_after_a_torn_last_line_cuts_it_and_keeps_the_rest(tmp_path):
    layout = RunLayout(tmp_path)
    summary.append_metrics(layout, 1, {"accuracy": 0.25})
    with open(layout.metrics, "a") as f:
        f.write('{"accuracy": 0.4, "itera')  # the master died here, writing iteration 4
    summary.append_metrics(layout, 4, {"accuracy": 0.4})
    assert _lines(layout) == [{"iteration": 1, "accuracy": 0.25}, {"iteration": 4, "accuracy": 0.4}]


def test_an_iteration_is_written_once_and_a_damaged_complete_line_is_kept(tmp_path):
    layout = RunLayout(tmp_path)
    layout.metrics.write_text('{"iteration": 1, "accuracy": 0.25}\nnot json\n')
    summary.append_metrics(layout, 1, {"accuracy": 0.9})
    summary.append_metrics(layout, 4, {"accuracy": 0.4})
    assert layout.metrics.read_text().splitlines() == [
        '{"iteration": 1, "accuracy": 0.25}', "not json", '{"accuracy": 0.4, "iteration": 4}']
