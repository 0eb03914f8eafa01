"""The per-queue busy time a step's metrics report: the union of each queue's spans."""

from __future__ import annotations

import json

import pytest

from luwu_rt.exec.trace import Span, busy_by_queue, write_rank_traces


def _span(queue: str, start: float, end: float) -> Span:
    return Span(f"Load x {start}", queue, start, end, 4096, "nvme")


def test_busy_time_counts_overlapping_spans_of_a_queue_once():
    # an IO queue with reads in flight together: 0-4 and 1-3 overlap, 5-6 stands alone, 5.5-7 extends it
    spans = [_span("nvme_read", 0, 4), _span("nvme_read", 1, 3), _span("nvme_read", 5, 6),
             _span("nvme_read", 5.5, 7), _span("compute", 2, 9)]
    busy = busy_by_queue(spans)
    assert busy["nvme_read"] == pytest.approx(6.0)  # [0, 4] and [5, 7]
    assert busy["compute"] == pytest.approx(7.0)
    # no queue is busier than the step it ran in
    step = max(s.end_s for s in spans) - min(s.start_s for s in spans)
    assert all(v <= step for v in busy.values())


def test_rank_traces_hold_every_span_with_its_queue(tmp_path):
    path = tmp_path / "trace.json"
    write_rank_traces([[_span("compute", 0, 1)], [_span("reduce", 0.5, 2)]], path,
                      extra=[("node", [_span("optim", 1, 3)])])
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["pid"], e["tid"]) for e in spans] == [(0, "compute"), (1, "reduce"), (2, "optim")]
    assert spans[1]["dur"] == pytest.approx(1.5e6)
    names = [e["args"]["name"] for e in events if e["ph"] == "M"]
    assert names == ["rank 0", "rank 1", "node"]
