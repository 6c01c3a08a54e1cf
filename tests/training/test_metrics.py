"""metrics.jsonl: what a job appends, what a reader gets back (Note [Metrics file])."""

import json

import pytest

from hpcgrad.training.metrics import MetricsLog, read_metrics


def test_lines_round_trip_and_nan_becomes_null(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.write("step", 1, 0, 0.5, loss=2.0)
        log.write("epoch", 1, 1, 0.9, loss=1.5, test_accuracy=float("nan"))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"kind": "epoch", "step": 1, "epoch": 1, "time": 0.9,
                                    "loss": 1.5, "test_accuracy": None}
    assert [(r["kind"], r["loss"]) for r in read_metrics(tmp_path)] == [("step", 2.0), ("epoch", 1.5)]


def test_other_ranks_write_nothing(tmp_path):
    with MetricsLog(tmp_path / "run", rank=1) as log:
        log.write("step", 1, 0, 0.1, loss=1.0)
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_overrides_the_steps_it_redid_and_a_torn_line_is_skipped(tmp_path):
    with MetricsLog(tmp_path) as log:
        for step in (1, 2, 3):
            log.write("step", step, 0, step, loss=10.0 + step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "st')  # killed mid-line
        f.write("\n")
    with MetricsLog(tmp_path) as log:  # resumed from step 2's checkpoint
        log.write("step", 3, 0, 9.0, loss=3.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 11.0), (2, 12.0), (3, 3.0)]


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match="kind must be 'step' or 'epoch'"):
        MetricsLog(tmp_path).write("batch", 1, 0, 0.0)
    (tmp_path / "metrics.jsonl").write_text('[1, 2]\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1: expected an object"):
        read_metrics(tmp_path)
