"""The flight recorder: ring order and states, per-group numbering, dumps that never raise, SIGUSR2."""

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from hpcgrad.comm import flight_recorder
from hpcgrad.comm.flight_recorder import FlightRecorder, capacity_from_env

SCRIPTS = Path(__file__).parents[1] / "scripts"
A4 = np.zeros(4, np.float32)


def _recorder(tmp_path, capacity=8, rank=0):
    recorder = FlightRecorder(capacity, rank, 2, directory=str(tmp_path))
    return recorder, recorder.register_group([0, 1], "default")


def test_states_and_order(tmp_path):
    recorder, g = _recorder(tmp_path)
    done = recorder.begin(g, 1, "allreduce", None, A4)
    recorder.end(done)
    failed = recorder.begin(g, 2, "broadcast", None, np.zeros(3, np.float64))
    recorder.end(failed, ok=False)
    recorder.begin(g, 3, "send", 1, A4)  # never ends
    entries = recorder.entries()
    assert [(e["op"], e["seq"], e["state"]) for e in entries] == [
        ("allreduce", 1, "complete"), ("broadcast", 2, "failed"), ("send", 3, "posted")]
    assert entries[1]["count"] == 3 and entries[1]["dtype"] == "float64"
    assert entries[2]["peer"] == 1 and entries[2]["end"] is None
    assert entries[0]["start"] <= entries[0]["end"] <= entries[1]["start"]


def test_collectives_are_numbered_per_group_apart_from_point_to_point(tmp_path):
    recorder, g = _recorder(tmp_path)
    sub = recorder.register_group([1], "sub")
    for group, op, peer in [(g, "allreduce", None), (g, "send", 1), (sub, "barrier", None),
                            (g, "recv", 1), (g, "allreduce", None)]:
        recorder.end(recorder.begin(group, 0, op, peer, A4))
    numbers = [(e["group"], e["op"], e["collective"]) for e in recorder.entries()]
    assert numbers == [(0, "allreduce", 1), (0, "send", None), (1, "barrier", 1),
                       (0, "recv", None), (0, "allreduce", 2)]
    assert recorder.groups() == [("default", [0, 1]), ("sub", [1])]


def test_the_ring_keeps_the_last_calls_and_a_late_end_leaves_the_new_entry(tmp_path):
    recorder = FlightRecorder(64, directory=str(tmp_path))  # 64: the smallest ring kept
    g = recorder.register_group([0])
    slots = [recorder.begin(g, seq, "allreduce", None, A4) for seq in range(1, 101)]
    recorder.end(slots[10])  # its entry was overwritten by call 75
    entries = recorder.entries()
    assert [e["seq"] for e in entries] == list(range(37, 101))
    assert all(e["state"] == "posted" for e in entries)
    assert recorder.snapshot("x")["recorded"] == 100


def test_capacity_zero_dumps_no_entries_but_still_tracks_the_latest_calls(tmp_path):
    recorder = FlightRecorder(0, directory=str(tmp_path))
    g = recorder.register_group([0])
    recorder.end(recorder.begin(g, 1, "allreduce", None, A4))
    recorder.begin(g, 2, "barrier", None, A4)
    assert recorder.entries() == []
    latest, p2p = recorder.latest()
    assert latest[g]["op"] == "barrier" and latest[g]["state"] == "posted" and p2p is None


def test_latest_reports_each_groups_last_collective_and_the_last_point_to_point(tmp_path):
    recorder, g = _recorder(tmp_path)
    sub = recorder.register_group([0, 1], "sub")
    recorder.end(recorder.begin(sub, 1, "allgather", None, A4))
    recorder.end(recorder.begin(g, 1, "allreduce", None, A4))
    recorder.begin(g, 2, "recv", 1, A4)
    recorder.begin(g, 3, "allreduce", None, A4)
    groups, p2p = recorder.latest()
    assert (groups[g]["collective"], groups[g]["state"]) == (2, "posted")
    assert (groups[sub]["op"], groups[sub]["state"]) == ("allgather", "complete")
    assert (p2p["op"], p2p["peer"], p2p["state"]) == ("recv", 1, "posted")


def test_threads_never_share_a_slot(tmp_path):
    recorder = FlightRecorder(4000, directory=str(tmp_path))
    groups = [recorder.register_group([0], f"g{i}") for i in range(4)]

    def calls(group):
        for seq in range(1, 501):
            recorder.end(recorder.begin(group, seq, "allreduce", None, A4))

    threads = [threading.Thread(target=calls, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    entries = recorder.entries()
    assert len(entries) == 2000 and all(e["state"] == "complete" for e in entries)
    for g in groups:  # one writer per group: its numbers are 1..500 in order
        assert [e["collective"] for e in entries if e["group"] == g] == list(range(1, 501))


def test_dump_is_atomic_json_with_the_header(tmp_path):
    recorder, g = _recorder(tmp_path, rank=1)
    recorder.end(recorder.begin(g, 1, "allreduce", None, A4))
    path = recorder.dump("timeout: allreduce #1")
    assert path == str(tmp_path / "flight_rank1.json")
    record = json.loads(Path(path).read_text())
    assert {k: record[k] for k in ("version", "rank", "world_size", "reason", "capacity")} == {
        "version": 1, "rank": 1, "world_size": 2, "reason": "timeout: allreduce #1",
        "capacity": 8}
    assert record["pid"] == os.getpid() and record["host"]
    assert record["groups"] == [{"id": 0, "name": "default", "ranks": [0, 1]}]
    assert [e["op"] for e in record["entries"]] == ["allreduce"]
    assert os.listdir(tmp_path) == ["flight_rank1.json"]  # no temporary left behind


def test_events_of_the_job_ride_along_in_every_later_record(tmp_path):
    recorder, g = _recorder(tmp_path)
    assert recorder.snapshot("x")["events"] == []
    recorder.event("world changed", old_size=4, new_size=3, lost=[1])
    for n in range(40):  # a long job keeps the newest few
        recorder.event("world changed", old_size=4, new_size=3, lost=[n])
    record = json.loads(Path(recorder.dump("process failure")).read_text())
    assert len(record["events"]) == 32 and record["events"][-1]["lost"] == [39]
    assert record["events"][-1]["what"] == "world changed" and record["events"][-1]["time"] > 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_dump_never_raises_it_logs(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    recorder = FlightRecorder(8, directory=str(locked / "flight"))
    assert recorder.dump("abort") is None
    assert "could not write the flight record (abort)" in capsys.readouterr().err


def test_dump_into_a_path_that_is_a_file_logs_instead_of_raising(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    recorder = FlightRecorder(8, directory=str(blocker))
    assert recorder.dump("timeout") is None
    assert "could not write the flight record (timeout)" in capsys.readouterr().err


@pytest.mark.parametrize("raw, expected", [("", 2000), ("0", 0), (" 16 ", 16)])
def test_capacity_from_env(monkeypatch, raw, expected):
    monkeypatch.setenv(flight_recorder.CAPACITY_ENV, raw)
    assert capacity_from_env() == expected


@pytest.mark.parametrize("raw", ["-1", "many", "1.5"])
def test_capacity_from_env_refuses_nonsense(monkeypatch, raw):
    monkeypatch.setenv(flight_recorder.CAPACITY_ENV, raw)
    with pytest.raises(ValueError, match="HPCGRAD_FLIGHT_RECORDER must be a whole number"):
        capacity_from_env()


def test_sigusr2_dumps_while_the_main_thread_is_blocked_in_mpi(launch, tmp_path):
    job = launch([sys.executable, str(SCRIPTS / "flight_signal.py")],
                 env={"HPCGRAD_FLIGHT_DIR": str(tmp_path)}, timeout=60)
    assert job.returncode == 0, job.output
    assert "installed: True" in job.stdout
    assert "dumped while blocked: True" in job.stdout, job.output
    assert "reason: signal SIGUSR2; last call: recv from 0, posted" in job.stdout, job.output


def test_a_bad_capacity_is_an_error_at_import():
    """Not a silent default: the user asked for something and learns it was not taken."""
    done = subprocess.run([sys.executable, "-c", "import hpcgrad.distributed"],
                          env=dict(os.environ, HPCGRAD_FLIGHT_RECORDER="lots"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "HPCGRAD_FLIGHT_RECORDER must be a whole number of entries >= 0" in done.stderr
