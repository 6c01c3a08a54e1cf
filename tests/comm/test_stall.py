"""The stall inspector: what rank 0 reports from the ranks' published calls, and a launched 3-rank stall."""

import json
import sys
from pathlib import Path

import pytest

from hpcgrad.comm import stall

SCRIPTS = Path(__file__).parents[1] / "scripts"
NOW = 1000.0
GROUPS = [("default", [0, 1, 2])]


def _call(number, op="allreduce", started=NOW - 5, ended=None, group=0, peer=None, slot=0):
    return {"slot": slot, "group": group, "seq": number, "collective": None if peer is not None else number,
            "op": op, "peer": peer, "count": 4, "dtype": "float32",
            "state": "posted" if ended is None else "complete", "start": started, "end": ended}


def _state(*calls, p2p=None, sent=NOW):
    return {"groups": {c["group"]: c for c in calls}, "p2p": p2p, "sent": sent, "interval": 1.0}


def test_a_rank_that_has_not_reached_the_call_is_named():
    states = {0: _state(_call(3)), 1: _state(_call(3, started=NOW - 4)),
              2: _state(_call(2, started=NOW - 7, ended=NOW - 6))}
    found = stall.find_stall(states, GROUPS, NOW, warning=1)
    assert (found["group"], found["collective"]) == (0, 3)
    assert found["waiting"] == {0: 5, 1: 4} and found["behind"] == [2]
    text = stall.stall_report(found, states, GROUPS, NOW, 1, "/flight")
    head, *lines = text.splitlines()
    assert head == ("[hpcgrad stall inspector] allreduce #3 (4 x float32) on group default ("
                    "world ranks 0-2) has waited 5.0 s on ranks 0, 1; not reached by rank 2 "
                    "(over HPCGRAD_STALL_WARNING=1 s).")
    assert lines[0] == "  rank 0: waiting in allreduce #3 (4 x float32) on group default for 5.0 s"
    assert lines[2] == ("  rank 2: not in a communication call for 6.0 s; last: allreduce #2 "
                        "(4 x float32) on group default, complete")
    assert lines[3].endswith("python -m hpcgrad.flight /flight")


def test_what_a_behind_rank_is_doing_names_its_point_to_point_wait():
    recv = _call(0, op="recv", started=NOW - 3, peer=1)
    states = {0: _state(_call(3)), 1: _state(_call(3)),
              2: _state(_call(2, ended=NOW - 4), p2p=recv)}
    text = stall.stall_report(stall.find_stall(states, GROUPS, NOW, 1), states, GROUPS, NOW, 1, "d")
    assert "  rank 2: waiting in recv from rank 1 (4 x float32) on group default for 3.0 s" in text


def test_every_rank_in_the_call_with_different_operations():
    states = {0: _state(_call(3)), 1: _state(_call(3)), 2: _state(_call(3, op="broadcast"))}
    found = stall.find_stall(states, GROUPS, NOW, 1)
    text = stall.stall_report(found, states, GROUPS, NOW, 1, "d")
    assert found["behind"] == [] and sorted(found["waiting"]) == [0, 1, 2]
    assert ("every rank reached it, yet it has not completed (the ranks called different "
            "operations or sizes)") in text


def test_silent_ranks_and_stale_reports_are_said_so():
    states = {0: _state(_call(3)), 1: None, 2: _state(_call(2, ended=NOW - 30), sent=NOW - 20)}
    found = stall.find_stall(states, GROUPS, NOW, 1)
    assert found["behind"] == [2] and found["silent"] == [1]
    text = stall.stall_report(found, states, GROUPS, NOW, 1, "d")
    assert "not reached by ranks 1, 2" in text
    assert "rank 1: no report yet" in text and "(as of 20 s ago)" in text


def test_no_report_under_the_warning_or_when_calls_complete():
    assert stall.find_stall({0: _state(_call(3, started=NOW - 0.5)), 1: None}, GROUPS, NOW, 1) is None
    done = {r: _state(_call(3, ended=NOW - 1)) for r in range(3)}
    assert stall.find_stall(done, GROUPS, NOW, 1) is None


def test_the_oldest_waiting_call_is_the_stall():
    sub = ("sub", [1, 2])
    states = {0: _state(_call(3, started=NOW - 2)),
              1: _state(_call(3, started=NOW - 2), _call(7, group=1, started=NOW - 9)),
              2: _state(_call(2, ended=NOW - 10), _call(6, group=1, ended=NOW - 10))}
    found = stall.find_stall(states, GROUPS + [sub], NOW, 1)
    assert (found["group"], found["collective"], found["behind"]) == (1, 7, [2])


@pytest.mark.parametrize("raw, expected", [("", 60.0), ("0", 0.0), ("2.5", 2.5)])
def test_warning_from_env(monkeypatch, raw, expected):
    monkeypatch.setenv(stall.WARNING_ENV, raw)
    assert stall.warning_from_env() == expected


@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "inf"])
def test_warning_from_env_refuses_nonsense(monkeypatch, raw):
    monkeypatch.setenv(stall.WARNING_ENV, raw)
    with pytest.raises(ValueError, match="HPCGRAD_STALL_WARNING must be a number of seconds"):
        stall.warning_from_env()


def test_rank_0_names_the_late_rank_and_every_rank_leaves_a_record(launch, tmp_path):
    """3 ranks; rank 2 sleeps 3 s before the third all_reduce; warning after 1 s."""
    job = launch([sys.executable, str(SCRIPTS / "flight_stall.py")], nprocs=3, timeout=60,
                 env={"HPCGRAD_STALL_WARNING": "1", "HPCGRAD_FLIGHT_DIR": str(tmp_path)})
    assert job.returncode == 0 and not job.timed_out, job.output
    for rank in range(3):
        assert f"[rank {rank}] all_reduce gives [81.0, 81.0, 81.0, 81.0]" in job.stdout, job.output
        assert f"[rank {rank}] done" in job.stdout
    blocks = [b for b in job.stderr.split("[hpcgrad stall inspector] ")[1:]]
    assert blocks, job.output
    head = blocks[0].splitlines()[0]
    assert head.startswith("allreduce #3 (4 x float32) on group default (world ranks 0-2) "
                           "has waited "), job.stderr
    assert "not reached by rank 2 " in head, job.stderr
    assert "  rank 2: not in a communication call for " in blocks[0], job.stderr
    # Rank 0 asked every rank for its record when it saw the stall.
    reasons = {r: json.loads((tmp_path / f"flight_rank{r}.json").read_text())["reason"]
               for r in range(3)}
    assert reasons[2] == "stall reported by rank 0: allreduce #3 on group default", reasons


def test_a_point_to_point_wait_names_the_peer_and_what_it_does():
    recv = _call(0, op="recv", started=NOW - 4, peer=2)
    states = {0: _state(_call(1, ended=NOW - 5), p2p=recv), 1: _state(),
              2: _state(_call(1, ended=NOW - 5), p2p=_call(0, op="send", started=NOW - 6,
                                                           ended=NOW - 5.5, peer=1))}
    assert stall.find_stall(states, GROUPS, NOW, 1) is None
    text, picture = stall.p2p_stall_report(states, GROUPS, NOW, 1)
    assert picture == ((0, 0),)
    assert ("  rank 0: waiting in recv from rank 2 (4 x float32) on group default for 4.0 s; "
            "(world) rank 2: not in a communication call for 5.0 s; last: allreduce #1") in text
    assert stall.p2p_stall_report(states, GROUPS, NOW, 10) == (None, None)
