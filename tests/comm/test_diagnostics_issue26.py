"""Diagnostics tell the truth (issue 26): one stall warning agreed by all ranks, no unpickling of
diagnostics messages, SIGUSR2 without a process group, groups named as registered, and a
flight tool that names the ranks whose records are missing."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcgrad.comm import stall

SCRIPTS = Path(__file__).parents[1] / "scripts"
BOUND = 60  # seconds: a job that hangs is killed and fails the test (they end in a few seconds)


class _Gathered:
    """A communicator whose Allgather returns the given ranks' values (rank ``rank`` of them)."""

    def __init__(self, values, rank=0):
        self.values, self.rank = values, rank

    def Get_size(self):
        return len(self.values)

    def Get_rank(self):
        return self.rank

    def Allgather(self, send, recv):
        assert send[0] == self.values[self.rank] or np.isnan(send[0])
        recv[:] = self.values


class _Out(list):
    def write(self, text):
        self.append(text)

    def flush(self):
        pass


@pytest.mark.parametrize("values, agreed", [([60.0, 1.0], 1.0), ([0.0, 5.0, 2.0], 2.0),
                                            ([0.0, 0.0], 0.0), ([3.0, 3.0], 3.0)])
def test_the_ranks_agree_on_the_smallest_warning_that_is_on(values, agreed):
    out = _Out()
    assert stall.agree_warning(_Gathered(values), values[0], out) == agreed
    if len(set(values)) == 1:
        assert out == []
    else:
        assert len(out) == 1 and out[0].endswith("\n"), out
        assert out[0].startswith("[hpcgrad stall inspector] HPCGRAD_STALL_WARNING differs across "
                                 "ranks ("), out
        assert f"every rank uses the smallest setting that is on: {agreed:g} s" in out[0], out


def test_only_rank_0_says_the_ranks_differ():
    out = _Out()
    assert stall.agree_warning(_Gathered([60.0, 1.0], rank=1), 1.0, out) == 1.0
    assert out == []


def test_a_bad_setting_on_one_rank_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv(stall.WARNING_ENV, "2")
    with pytest.raises(ValueError, match=r"HPCGRAD_STALL_WARNING on rank 1 is not a number of "
                                         r"seconds >= 0"):
        stall.agree_warning(_Gathered([2.0, float("nan")]), None, _Out())
    monkeypatch.setenv(stall.WARNING_ENV, "soon")
    with pytest.raises(ValueError, match=r"HPCGRAD_STALL_WARNING must be a number of seconds"):
        stall.agree_warning(_Gathered([float("nan"), 2.0]), None, _Out())


@pytest.mark.parametrize("warnings", [",1", "0,1"], ids=["unset-and-1", "off-and-1"])
def test_a_stall_is_reported_when_the_ranks_set_different_warnings(launch, tmp_path, warnings):
    """Rank 1 reaches the second all_reduce 3 s late. Before: rank 0 inspected at its own 60 s
    and the stall was silent; with 0 on rank 0, rank 1 alone duplicated the communicator."""
    job = launch([sys.executable, str(SCRIPTS / "stall_disagree.py")], nprocs=2, timeout=BOUND,
                 env={"STALL_WARNINGS": warnings, "HPCGRAD_FLIGHT_DIR": str(tmp_path),
                      # The stall inspector alone: a call check's own wait is another matter.
                      "HPCGRAD_DISTRIBUTED_DEBUG": "OFF"})
    assert job.returncode == 0 and not job.timed_out, job.output
    for rank in range(2):
        assert f"[rank {rank}] done" in job.stdout, job.output
    first = "60 s on rank 0" if warnings == ",1" else "0 (off) on rank 0"
    assert "[hpcgrad stall inspector] HPCGRAD_STALL_WARNING differs across ranks (" in job.stderr
    assert first in job.stderr and "1 s on rank 1" in job.stderr, job.stderr
    assert "every rank uses the smallest setting that is on: 1 s" in job.stderr, job.stderr
    assert ("[hpcgrad stall inspector] allreduce #2 (4 x float32) on group default (world "
            "ranks 0, 1) has waited ") in job.stderr, job.stderr
    assert "; not reached by rank 1 (over HPCGRAD_STALL_WARNING=1 s)." in job.stderr, job.stderr


# --- 2. no unpickling of diagnostics messages ---------------------------------------------
class _Creates:
    """A pickle that creates ``path`` when unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state():
    call = {"slot": 7, "group": 0, "seq": 3, "collective": 3, "op": "allreduce", "peer": None,
            "count": 4, "dtype": "float32", "state": "posted", "start": 1000.5, "end": None}
    recv = dict(call, slot=8, collective=None, op="recv", peer=1, state="complete", end=1001.0)
    return {"groups": {0: call}, "p2p": recv, "sent": 1002.0, "interval": 1.0}


def test_a_state_travels_as_json_and_comes_back_equal():
    data = stall.encode_state(_state())
    assert isinstance(data, bytes) and data.startswith(b"[")
    assert stall.decode_state(data) == _state()


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_pickled_state_is_refused_and_runs_nothing(tmp_path, protocol):
    import pickle
    target = tmp_path / "ran"
    for payload in (_Creates(target), [1.0, 1.0, [_Creates(target)], None]):
        with pytest.raises(ValueError):
            stall.decode_state(pickle.dumps(payload, protocol=protocol))
    assert not target.exists()


@pytest.mark.parametrize("field, value", [("count", "4"), ("state", "lost"), ("group", -1),
                                          ("start", float("inf")), ("peer", True)])
def test_a_state_with_a_field_of_the_wrong_type_is_refused(field, value):
    state = _state()
    state["groups"][0][field] = value
    with pytest.raises(ValueError, match=f"field '{field}' of a call is"):
        stall.decode_state(stall.encode_state(state))


def test_crafted_pickles_run_nothing_and_the_inspector_carries_on(launch, tmp_path):
    """Rank 1 sends rank 0 a pickle as a state, rank 0 sends rank 1 one as a dump request;
    each would create a file if unpickled. Before: rank 0 unpickled (the file appeared), then
    its inspector stopped on the result, and the later 3 s stall was never reported."""
    job = launch([sys.executable, str(SCRIPTS / "stall_untrusted.py")], nprocs=2, timeout=BOUND,
                 env={"HPCGRAD_STALL_WARNING": "1", "CRAFTED_DIR": str(tmp_path),
                      "HPCGRAD_FLIGHT_DIR": str(tmp_path / "flight")})
    assert job.returncode == 0 and not job.timed_out, job.output
    assert list(tmp_path.glob("ran_on_rank*")) == [], job.output
    for rank in range(2):
        assert f"[rank {rank}] crafted pickle ran here: False" in job.stdout, job.output
        assert f"[rank {rank}] done" in job.stdout, job.output
    assert ("[hpcgrad stall inspector] rank 0: ignored a state message from rank 1 that is not "
            "one (") in job.stderr, job.stderr
    assert ("[hpcgrad stall inspector] rank 1: ignored a dump request from rank 0 that is not "
            "one (") in job.stderr, job.stderr
    assert ("[hpcgrad stall inspector] allreduce #2 (4 x float32) on group default (world "
            "ranks 0, 1) has waited ") in job.stderr, job.stderr
    assert "; not reached by rank 1 (over HPCGRAD_STALL_WARNING=1 s)." in job.stderr, job.stderr


# --- 3. SIGUSR2 without a process group ---------------------------------------------------
@pytest.mark.parametrize("mode, nprocs", [("alone", None), ("rpc", 2)], ids=["no-group", "rpc-only"])
def test_sigusr2_dumps_without_a_process_group_and_the_rank_lives(launch, tmp_path, mode, nprocs):
    """No init_process_group: a program that only imports hpcgrad, and an RPC-only job (SIGUSR2
    killed its ranks: nothing had installed the handler). Each rank signals itself, finds its
    record written, and (RPC) still serves its peer's call; the job exits 0."""
    job = launch([sys.executable, str(SCRIPTS / "diag_sigusr2.py"), mode], nprocs=nprocs,
                 timeout=BOUND, env={"HPCGRAD_FLIGHT_DIR": str(tmp_path)})
    assert job.returncode == 0 and not job.timed_out, job.output
    for rank in range(nprocs or 1):
        assert f'[rank {rank}] dumped: True (reason "signal SIGUSR2")' in job.stdout, job.output
        assert f"[rank {rank}] done" in job.stdout, job.output
        record = json.loads((tmp_path / f"flight_rank{rank}.json").read_text())
        assert (record["rank"], record["world_size"]) == (rank, nprocs or 1), record
    if mode == "rpc":
        assert "[rank 0] rpc to worker1 gives 40" in job.stdout, job.output
        assert "[rank 1] rpc to worker0 gives 41" in job.stdout, job.output


# --- 4. groups named as registered --------------------------------------------------------
NOW = 1000.0
DDP_GROUPS = [("default", [0, 1]), ("DDP(default)", [0, 1])]


def _call(number, group, ended=None, started=NOW - 5):
    return {"slot": number, "group": group, "seq": number, "collective": number,
            "op": "allreduce", "peer": None, "count": 4, "dtype": "float32",
            "state": "posted" if ended is None else "complete", "start": started, "end": ended}


def _published(*calls):
    return {"groups": {c["group"]: c for c in calls}, "p2p": None, "sent": NOW, "interval": 1.0}


def test_the_stall_inspector_names_ddps_communicator_as_registered():
    """DDP's private communicator registered as "DDP(default)" (group id 1): rank 0 waits in
    its allreduce #12, rank 1 has finished #11 there. Every line names DDP(default), none
    reads as the default group's."""
    states = {0: _published(_call(4, 0, ended=NOW - 9), _call(12, 1)),
              1: _published(_call(4, 0, ended=NOW - 9), _call(11, 1, ended=NOW - 6))}
    found = stall.find_stall(states, DDP_GROUPS, NOW, 1)
    text = stall.stall_report(found, states, DDP_GROUPS, NOW, 1, "d")
    head, *lines = text.splitlines()
    assert head == ("[hpcgrad stall inspector] allreduce #12 (4 x float32) on group DDP(default) "
                    "(world ranks 0, 1) has waited 5.0 s on rank 0; not reached by rank 1 (over "
                    "HPCGRAD_STALL_WARNING=1 s).")
    assert lines[0] == ("  rank 0: waiting in allreduce #12 (4 x float32) on group DDP(default) "
                        "for 5.0 s")
    assert lines[1] == ("  rank 1: not in a communication call for 6.0 s; last: allreduce #11 "
                        "(4 x float32) on group DDP(default), complete")
    assert "group 0" not in text and "group 1" not in text


def test_unnamed_and_shared_names_keep_their_id():
    groups = DDP_GROUPS + [("2", [0]), ("DDP(default)", [0, 1])]
    assert stall.group_label(0, groups) == "group default"
    assert stall.group_label(2, groups) == "group 2"
    assert stall.group_label(1, groups) == "group DDP(default) [id 1]"
    assert stall.group_label(3, groups) == "group DDP(default) [id 3]"
    assert stall.group_label(7, groups) == "group 7 (not registered on rank 0)"


def test_the_flight_tool_names_ddps_communicator_as_registered(tmp_path, capsys):
    from hpcgrad import flight
    groups = [{"id": gid, "name": name, "ranks": ranks} for gid, (name, ranks)
              in enumerate(DDP_GROUPS)]
    for rank, last in ((0, 12), (1, 11)):
        entries = [_call(4, 0, ended=NOW - 9)] + [
            _call(n, 1, ended=None if n == 12 else NOW - 6) for n in range(1, last + 1)]
        record = {"version": 1, "rank": rank, "world_size": 2, "host": "h", "pid": 1,
                  "reason": "timeout", "time": NOW + 1, "capacity": 2000,
                  "recorded": len(entries), "groups": groups, "entries": entries}
        (tmp_path / f"flight_rank{rank}.json").write_text(json.dumps(record))
    status = flight.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 1, out
    assert ("FIRST DIVERGENCE: rank 1 diverged at collective #12 of group DDP(default): rank 0 "
            "posted allreduce #12 (4 x float32); rank 1 never did.") in out
    assert ("  rank 1's last collective on group DDP(default): allreduce #11 (4 x float32) on "
            "group DDP(default), complete") in out
    assert "group 0" not in out and "group 1" not in out


# --- 5. the flight tool names missing ranks -----------------------------------------------
def _flight_record(directory, rank, entries, world=3):
    record = {"version": 1, "rank": rank, "world_size": world, "host": "h", "pid": 100 + rank,
              "reason": "timeout", "time": NOW + 100, "capacity": 2000,
              "recorded": len(entries),
              "groups": [{"id": 0, "name": "default", "ranks": list(range(world))}],
              "entries": entries}
    (directory / f"flight_rank{rank}.json").write_text(json.dumps(record))


def test_records_of_2_of_3_ranks_name_the_missing_rank_and_never_agree(tmp_path):
    """Ranks 0 and 1 completed allreduce #1-#3 and wrote records; rank 2 (world size 3) wrote
    none. Before: "The records agree" and status 0, on a third of the job missing."""
    for rank in (0, 1):
        _flight_record(tmp_path, rank, [_call(n, 0, ended=NOW - 1) for n in (1, 2, 3)])
    done = subprocess.run([sys.executable, "-m", "hpcgrad.flight", str(tmp_path)],
                          capture_output=True, text=True, timeout=BOUND, check=False)
    assert done.returncode == 3, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("Flight records of ranks 0, 1 (world size 3).\n"), out
    assert "MISSING: no record from rank 2 of the 3 ranks" in out, out
    assert ("No divergence among the records of ranks 0, 1, but this is partial evidence, not "
            "agreement: rank 2 may be where the job diverged") in out, out
    assert "agree:" not in out and "records agree" not in out.lower(), out
    found = json.loads(subprocess.run([sys.executable, "-m", "hpcgrad.flight", "--json",
                                       str(tmp_path)], capture_output=True, text=True,
                                      timeout=BOUND, check=False).stdout)
    assert (found["missing_dumps"], found["complete"], found["consistent"]) == ([2], False, False)


def test_a_group_in_progress_with_a_missing_rank_is_not_called_agreed(tmp_path, capsys):
    from hpcgrad import flight
    for rank in (0, 1):
        _flight_record(tmp_path, rank, [_call(1, 0, ended=NOW - 1), _call(2, 0)])
    assert flight.main([str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert ("Every rank of group default with a record (ranks 0, 1) was inside allreduce #2 "
            "(4 x float32), not completed, when it wrote it; rank 2 left no record: it may "
            "never have reached allreduce #2 (4 x float32).") in out, out
    assert "agree on it" not in out and "records agree" not in out.lower(), out


def test_a_divergence_with_a_missing_rank_exits_1_and_names_both(tmp_path, capsys):
    from hpcgrad import flight
    _flight_record(tmp_path, 0, [_call(1, 0, ended=NOW - 1), _call(2, 0)])
    _flight_record(tmp_path, 1, [_call(1, 0, ended=NOW - 1)])
    assert flight.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISSING: no record from rank 2 of the 3 ranks" in out, out
    assert "FIRST DIVERGENCE: rank 1 diverged at collective #2 of group default" in out, out


def test_records_from_runs_of_different_sizes_are_said_so(tmp_path, capsys):
    from hpcgrad import flight
    _flight_record(tmp_path, 0, [_call(1, 0, ended=NOW - 1)], world=2)
    _flight_record(tmp_path, 1, [_call(1, 0, ended=NOW - 1)], world=3)
    assert flight.main([str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert ("The records disagree on the world size (2 on rank 0; 3 on rank 1): some are from "
            "another run") in out, out
