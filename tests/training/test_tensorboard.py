"""hpcgrad.utils.tensorboard.SummaryWriter (tensorboardX's, taking hpcgrad Tensors) and the
metrics log's TensorBoard events, read back from the event files' own records."""

import glob
import struct

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.training.metrics import MetricsLog

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # noqa: E402

from hpcgrad.utils.tensorboard import SummaryWriter  # noqa: E402


def events(directory):
    """Every event in ``directory``'s event files: TFRecords (length, its CRC, the Event
    protobuf, its CRC), parsed here rather than by a reader of the same library."""
    found = []
    for path in sorted(glob.glob(f"{directory}/events.out.tfevents.*")):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[offset + 12:offset + 12 + length])
            found.append(event)
            offset += 12 + length + 4
    return found


def scalars(directory):
    """{tag: [(step, value)]} of the scalar summaries."""
    found = {}
    for event in events(directory):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_scalars_from_tensors_floats_and_numpy_values(tmp_path):
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        writer.add_scalar("loss", hg.tensor(2.5), 1)
        writer.add_scalar("loss", np.float32(1.25), 2)
        writer.add_scalar("loss", 0.5, 3)
        writer.add_scalars("run", {"a": hg.tensor([3.0]).sum(), "b": 4.0}, 7)
        writer.add_histogram("weights", hg.tensor(np.arange(10.0)), 1)
    got = scalars(tmp_path)
    assert got["loss"] == [(1, 2.5), (2, 1.25), (3, 0.5)]
    # add_scalars: one run per key, in log_dir/main_tag/key, each under the main tag
    assert scalars(tmp_path / "run" / "a")["run"] == [(7, 3.0)]
    assert scalars(tmp_path / "run" / "b")["run"] == [(7, 4.0)]
    histograms = [v for e in events(tmp_path) for v in e.summary.value if v.HasField("histo")]
    assert histograms and histograms[0].histo.num == 10 and histograms[0].histo.max == 9.0


def test_the_metrics_log_writes_its_values_to_tensorboard(tmp_path):
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        log.write("step", 1, 0, 0.1, loss=2.0)
        log.write("step", 2, 0, 0.2, loss=1.5)
        log.write("epoch", 2, 1, 0.3, test_accuracy=0.75, samples_per_s=float("nan"))
    got = scalars(tmp_path / "tensorboard")
    assert got["step/loss"] == [(1, 2.0), (2, 1.5)]
    assert got["epoch/test_accuracy"] == [(2, 0.75)]
    assert "epoch/samples_per_s" not in got  # NaN is null in metrics.jsonl, absent here
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_a_resumed_run_purges_what_came_after_its_step(tmp_path):
    with MetricsLog(str(tmp_path), tensorboard=True, purge_step=5) as log:
        log.write("step", 6, 0, 0.1, loss=1.0)
    starts = [e for e in events(tmp_path / "tensorboard") if e.HasField("session_log")]
    assert starts and starts[0].step == 5 and starts[0].session_log.status == 1  # START


def test_other_ranks_write_nothing(tmp_path):
    with MetricsLog(str(tmp_path / "run"), rank=1, tensorboard=True) as log:
        log.write("step", 1, 0, 0.1, loss=2.0)
    assert not (tmp_path / "run").exists()
