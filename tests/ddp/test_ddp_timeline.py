"""DDP on the timeline (Note [DDP timeline]): per bucket a ready instant and an all-reduce span,
copies, finalize, in order within each step; the ranks' files merge into one trace."""

import json

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
from hpcgrad.ddp import buckets
from hpcgrad.ddp import reducer as reducer_module
from hpcgrad.distributed import comm_hooks
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.base.timeline import Timeline, merge

STEPS = 3  # the buckets are rebuilt at the second




def chain():
    """Weights of 96, 72 and 48 bytes: two buckets under 100-byte limits, before the rebuild
    ([c], [a, b]) and after it ([c, b], [a])."""
    return nn.Sequential(nn.Linear(4, 3, bias=False, dtype=np.float64), nn.Tanh(),
                         nn.Linear(3, 3, bias=False, dtype=np.float64), nn.Tanh(),
                         nn.Linear(3, 2, bias=False, dtype=np.float64))


def steps_of(events):
    """The events of each "step" span, in recorded order."""
    steps, current = [], None
    for e in events:
        if e["name"] == "step" and e["ph"] == "B":
            current = []
        if current is not None:
            current.append(e)
        if e["name"] == "step" and e["ph"] == "E":
            steps.append(current)
            current = None
    return steps


def only(events, name, ph, bucket=None):
    found = [e for e in events if e["name"] == name and e["ph"] == ph
             and (bucket is None or e.get("args", {}).get("bucket") == bucket)]
    assert len(found) == 1, (name, ph, bucket, found)
    return found[0]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("hook", [None, comm_hooks.allreduce_hook], ids=["allreduce", "hook"])
def test_buckets_all_reduces_and_finalize_in_order(group, monkeypatch, tmp_path, hook):
    # One directory for every rank's file: rank 0's.
    box = [str(tmp_path / "timeline.json")]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group)
    timeline = Timeline(box[0], group.rank())
    monkeypatch.setattr(reducer_module, "TIMELINE", timeline)
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 100)
    ddp = DDP(chain(), process_group=group, bucket_cap_mb=100 / 2 ** 20)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    x = hg.tensor(np.random.default_rng(group.rank()).standard_normal((5, 4)))
    for step in range(STEPS):
        with timeline.span("step", "test", step=step):
            ddp(x).sum().backward()
    assert len(ddp.reducer.buckets) == 2

    steps = steps_of(timeline.events())
    assert len(steps) == STEPS
    for events in steps:
        ts = [e["ts"] for e in events]
        assert ts == sorted(ts)  # one thread: recorded in time order
        copies = [e for e in events if e["name"] == "copy into bucket"]
        assert len(copies) == 2 * 3  # a begin and an end per parameter
        finalize_begin, finalize_end = only(events, "finalize", "B"), only(events, "finalize", "E")
        step_end = only(events, "step", "E")
        for b in range(2):
            ready = only(events, "bucket ready", "i", b)
            begin, end = only(events, "allreduce", "b", b), only(events, "allreduce", "e", b)
            last_copy = max(e["ts"] for e in copies if e["args"]["bucket"] == b)
            assert last_copy <= ready["ts"] <= begin["ts"] <= finalize_begin["ts"]
            assert begin["args"]["bytes"] > 0
            assert finalize_begin["ts"] <= end["ts"] <= finalize_end["ts"] <= step_end["ts"]
        launches = [e["args"]["bucket"] for e in events
                    if e["name"] == "allreduce" and e["ph"] == "b"]
        assert launches == [0, 1]  # strictly in bucket order

    timeline.save()
    dist.barrier(group=group)  # every rank's file is written
    if group.rank() == 0:
        assert merge(box[0]) == group.size()
        with open(box[0], encoding="utf-8") as f:
            merged = json.load(f)["traceEvents"]
        for rank in group.ranks:
            mine = [e for e in merged if e["pid"] == rank]
            assert sum(e["name"] == "allreduce" and e["ph"] == "e" for e in mine) == 2 * STEPS
    dist.barrier(group=group)  # nobody leaves while rank 0 reads the files
