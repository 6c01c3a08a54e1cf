"""HPCGRAD_TIMELINE: spans per rank in Chrome trace format, merged one process row per rank."""

import json
import sys

import pytest

from hpcgrad.base.timeline import Timeline, merge


def test_off_records_nothing_and_writes_nothing(tmp_path):
    timeline = Timeline(None)
    with timeline.span("forward"):
        timeline.instant("x")
    assert timeline.events() == [] and timeline.save() is None


def test_spans_nest_in_order(tmp_path):
    timeline = Timeline(str(tmp_path / "t.json"), rank=3)
    with timeline.span("step", "job", step=7):
        with timeline.span("backward"):
            timeline.instant("bucket 0 ready", "ddp", bucket=0)
    events = timeline.events()
    assert [(e["ph"], e["name"]) for e in events] == [
        ("B", "step"), ("B", "backward"), ("i", "bucket 0 ready"), ("E", "backward"), ("E", "step")]
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    assert events[0]["args"] == {"step": 7} and {e["pid"] for e in events} == {3}


def test_launched_ranks_merge_into_one_trace(launch, tmp_path):
    path = tmp_path / "timeline.json"
    job = launch([sys.executable, "tests/scripts/timeline_ranks.py"], nprocs=2,
                 env={"HPCGRAD_TIMELINE": str(path)}, timeout=60)
    assert not job.failed, job.output
    assert merge(str(path)) == 2
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        spans = [(e["ph"], e["name"]) for e in events if e["pid"] == rank and e["ph"] != "M"]
        assert spans == [("B", "forward"), ("E", "forward"), ("B", "backward"),
                         ("i", "bucket 0 ready"), ("E", "backward")]


def test_merge_without_files_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="HPCGRAD_TIMELINE="):
        merge(str(tmp_path / "none.json"))


def test_async_spans_carry_their_id(tmp_path):
    """Overlapping spans on one thread (bucket all-reduces) are Chrome async events with an id."""
    timeline = Timeline(str(tmp_path / "t.json"), rank=0)
    timeline.begin_async("allreduce", "ddp", 0, bucket=0)
    timeline.begin_async("allreduce", "ddp", 1, bucket=1)
    timeline.end_async("allreduce", "ddp", 0, bucket=0)
    timeline.end_async("allreduce", "ddp", 1, bucket=1)
    assert [(e["ph"], e["id"]) for e in timeline.events()] == [("b", 0), ("b", 1), ("e", 0), ("e", 1)]
