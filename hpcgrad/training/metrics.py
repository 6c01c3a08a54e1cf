"""metrics.jsonl: one JSON object per line (a step or an epoch), written by rank 0 of a run.

Note [Metrics file]
    A run directory holds its checkpoints and ``metrics.jsonl``. Each line is a flat JSON object
    with ``kind`` ("step" or "epoch"), ``step``, ``epoch``, ``time`` (seconds since the run
    started) and whatever the job measured (``loss``, ``test_loss``, ``test_accuracy``,
    ``samples_per_s``...). Lines are appended and flushed one by one, so a killed run leaves
    every line it finished; a resumed run appends to the same file, and ``read_metrics`` keeps,
    for each (kind, step), the last line written (the resumed run's, when it redid a step).
    ``python -m hpcgrad.plot RUN_DIR`` draws it. With ``tensorboard=True`` the same values also
    go to TensorBoard event files in ``RUN_DIR/tensorboard`` (tag ``<kind>/<name>``, at the
    step): ``tensorboard --logdir RUN_DIR/tensorboard``; a resumed run passes the step it
    resumed at as ``purge_step``, so TensorBoard drops what the earlier run logged after it.
"""

import json
import math
import os

FILE_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends metric lines to ``run_dir/metrics.jsonl`` (and, with ``tensorboard``, TensorBoard
    events to ``run_dir/tensorboard``); on ranks other than 0 it does nothing."""

    def __init__(self, run_dir, rank=0, tensorboard=False, purge_step=None):
        self.path = os.path.join(run_dir, FILE_NAME)
        self._file = self._writer = None
        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (closed in close())
            if tensorboard:
                from hpcgrad.training.tensorboard import SummaryWriter  # tensorboardX: an extra
                self._writer = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR),
                                             purge_step=purge_step)

    def write(self, kind, step, epoch, time, **values):
        """One line: ``kind`` is "step" or "epoch"; values must be numbers (NaN/inf become null)."""
        if kind not in ("step", "epoch"):
            raise ValueError(f"metrics kind must be 'step' or 'epoch', got {kind!r}")
        if self._file is None:
            return
        record = {"kind": kind, "step": int(step), "epoch": int(epoch), "time": float(time)}
        for name, value in values.items():
            value = float(value)
            record[name] = value if math.isfinite(value) else None  # JSON has no NaN
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for name, value in record.items():
                if name not in ("kind", "step", "epoch", "time") and value is not None:
                    self._writer.add_scalar(f"{kind}/{name}", value, int(step))

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(run_dir):
    """The lines of ``run_dir/metrics.jsonl`` as dicts, a redone (kind, step) keeping its last
    line, in step order. A torn last line (the run was killed while writing it) is skipped."""
    path = os.path.join(run_dir, FILE_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {FILE_NAME} in {run_dir}: point at the run directory a job "
                                "wrote (its --checkpoint-dir)")
    latest = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn by a kill; every complete line before it still counts
            if not isinstance(record, dict) or "kind" not in record or "step" not in record:
                raise ValueError(f"{path}:{number}: expected an object with 'kind' and 'step', "
                                 f"got {line[:80]!r}")
            latest[(record["kind"], record["step"])] = record
    return sorted(latest.values(), key=lambda r: (r["step"], r["kind"] == "epoch"))
