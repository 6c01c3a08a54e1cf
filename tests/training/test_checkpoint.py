"""Checkpoints: exact round trip, bitwise resume, a killed save keeps the old file, corrupt files."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import hpcgrad
from hpcgrad import checkpoint, nn
from hpcgrad.training.checkpoint import CheckpointError
from hpcgrad.data import DataLoader, synthetic_classification
from hpcgrad.optim import SGD, Adam, AdamW

SCRIPT = Path(__file__).parents[1] / "scripts" / "checkpoint_save_killed.py"
FEATURES, CLASSES = 4, 3


def make_model(seed):
    """An hpcgrad.nn classifier with dropout (draws from the global generator) and batch norm
    (float32 running statistics, an int64 counter), plus a float16 buffer to round-trip."""
    hpcgrad.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, CLASSES))
    model.register_buffer("scale16", hpcgrad.tensor(np.random.default_rng(seed).standard_normal(5),
                                                 dtype=np.float16))
    return model


def _make_optimizer(name, params):
    return {"sgd": lambda: SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
            "adam": lambda: Adam(params, lr=0.01, amsgrad=True),
            "adamw": lambda: AdamW(params, lr=0.01)}[name]()


def _train(model, optimizer, loader, epochs):
    """Cross-entropy epochs; the loader shuffles and dropout masks from hpcgrad's global generator,
    and inputs get noise from numpy's legacy generator, so a resume must restore both."""
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for x, y in loader:
            x = x + np.float32(np.random.standard_normal() * 0.01)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def _state(model):
    return {name: t.array.copy() for name, t in model.state_dict().items()}


def _assert_states_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_resume_is_bitwise_identical(tmp_path, opt_name):
    loader = DataLoader(synthetic_classification(48, FEATURES, CLASSES, seed=1), batch_size=8,
                        shuffle=True)
    path = tmp_path / "ckpt.npz"

    hpcgrad.manual_seed(0)
    np.random.seed(0)
    model = make_model(seed=0)
    optimizer = _make_optimizer(opt_name, model.parameters())
    _train(model, optimizer, loader, epochs=2)
    checkpoint.save(path, model, optimizer, epoch=2, history=[0.5, 0.25])
    _train(model, optimizer, loader, epochs=2)
    straight = _state(model)

    hpcgrad.manual_seed(123)  # different RNG states and weights: load must restore them all
    np.random.seed(123)
    resumed = make_model(seed=5)
    resumed_opt = _make_optimizer(opt_name, resumed.parameters())
    extra = checkpoint.load(path, resumed, resumed_opt)
    assert extra == {"epoch": 2, "history": [0.5, 0.25]}
    _train(resumed, resumed_opt, loader, epochs=2)
    _assert_states_equal(straight, _state(resumed))


def test_round_trip_restores_arrays_optimizer_and_rng(tmp_path):
    path = tmp_path / "ckpt.npz"
    model = make_model(seed=1)
    groups = [{"params": model[0].parameters()}, {"params": model[4].parameters(), "lr": 0.5}]
    optimizer = Adam(groups, betas=(0.8, 0.9), amsgrad=True)
    for p in model.parameters():
        p.grad = hpcgrad.ones(*p.shape)
    optimizer.step()
    hpcgrad.manual_seed(7)
    hpcgrad.randn(3)
    np.random.seed(8)
    np.random.standard_normal()  # leaves a cached Gaussian in the legacy state
    checkpoint.save(path, model, optimizer, step=1, note="first")
    expected_draws = hpcgrad.randn(4).array, np.random.standard_normal(3)
    saved, saved_opt = _state(model), optimizer.state_dict()

    other = make_model(seed=2)
    other_opt = Adam([{"params": other[0].parameters()}, {"params": other[4].parameters()}])
    hpcgrad.manual_seed(99)
    np.random.seed(99)
    assert checkpoint.load(path, other, other_opt) == {"step": 1, "note": "first"}
    _assert_states_equal(saved, _state(other))
    np.testing.assert_array_equal(hpcgrad.randn(4).array, expected_draws[0])
    np.testing.assert_array_equal(np.random.standard_normal(3), expected_draws[1])
    loaded_opt = other_opt.state_dict()
    assert loaded_opt["param_groups"] == saved_opt["param_groups"]  # incl. the tuple betas
    for index, entries in saved_opt["state"].items():
        assert set(loaded_opt["state"][index]) == set(entries)
        for key, value in entries.items():
            np.testing.assert_array_equal(loaded_opt["state"][index][key], value)


def test_save_refuses_non_json_extra_without_touching_file(tmp_path):
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, make_model(seed=1), step=1)
    before = path.read_bytes()
    with pytest.raises(TypeError, match="extra value 'weights' is not JSON-serializable"):
        checkpoint.save(path, make_model(seed=2), weights=np.zeros(2))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.npz"]


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, make_model(seed=1), step=1)
    before = path.read_bytes()

    def disk_full(file, **arrays):
        file.write(b"PK partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*No space left on "
                                              r"device.*previous checkpoint .* is untouched"):
        checkpoint.save(path, make_model(seed=2), step=2)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.npz"]


def check_killed_save(tmp_path, stage):
    """Save a good checkpoint, SIGKILL a second save stopped at `stage`, then check that the good
    file is byte-for-byte intact and loads, and that only a stray .tmp file is left."""
    path, ready = tmp_path / "ckpt.npz", tmp_path / "ready"
    good = make_model(seed=3)
    checkpoint.save(path, good, step=1)
    before = path.read_bytes()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), stage, str(path), str(ready)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the save never reached {stage}: "
                                     f"{proc.stdout.read().decode(errors='replace')}")
            time.sleep(0.05)
        tmp = Path(ready.read_text())
        assert tmp.parent == tmp_path and tmp.exists()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    assert path.read_bytes() == before, "the killed save must not touch the previous checkpoint"
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.npz", "ready", tmp.name])
    restored = make_model(seed=4)
    assert checkpoint.load(path, restored) == {"step": 1}
    _assert_states_equal(_state(good), _state(restored))
    return tmp


@pytest.mark.parametrize("stage", ["mid_write", "before_replace"])
def test_killed_save_leaves_previous_checkpoint(tmp_path, stage):
    tmp = check_killed_save(tmp_path, stage)
    if stage == "mid_write":  # the stray file is a partial archive
        with pytest.raises(CheckpointError):
            checkpoint.load(tmp, make_model(seed=4))
    else:  # complete but never renamed into place: it holds the second save
        assert checkpoint.load(tmp, _Sink()) == {"step": 999}


@pytest.mark.parametrize("stage", ["mid_write", "before_replace"])
def test_next_save_removes_temporary_of_killed_save(tmp_path, stage):
    """A killed save's full-size temporary does not stay forever: the next save of the same
    checkpoint removes it, and the new checkpoint loads."""
    stale = check_killed_save(tmp_path, stage)
    model = make_model(seed=5)
    checkpoint.save(tmp_path / "ckpt.npz", model, step=2)
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz", "ready"]
    restored = make_model(seed=6)
    assert checkpoint.load(tmp_path / "ckpt.npz", restored) == {"step": 2}
    _assert_states_equal(_state(model), _state(restored))


def _dead_pid():
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_save_removes_only_stale_temporaries_of_the_same_checkpoint(tmp_path):
    """Removed: ours, of this checkpoint, whose writer here is gone, or untouched for longer
    than ABANDONED_AFTER (any host, or the older name without one). Kept: a live writer's
    (this host), a recent one of another host, other checkpoints' and other files."""
    host, dead, live = checkpoint._HOST, _dead_pid(), os.getppid()
    old = time.time() - checkpoint.ABANDONED_AFTER - 60
    files = {
        f".ckpt.npz.{host}.{dead}.0123abcd.tmp": ("removed", None),
        f".ckpt.npz.otherhost.{dead}.89abcdef.tmp": ("removed", old),
        f".ckpt.npz.{dead}.00ff00ff.tmp": ("removed", old),  # name without a host
        f".ckpt.npz.{host}.{live}.0123abcd.tmp": ("kept", None),  # a live save here
        f".ckpt.npz.{host}.{os.getpid()}.0123abcd.tmp": ("kept", None),  # another thread's
        f".ckpt.npz.otherhost.{dead}.0123abcd.tmp": ("kept", None),  # maybe live elsewhere
        f".ckpt.npz.x.{host}.{dead}.0123abcd.tmp": ("kept", old),  # checkpoint 'ckpt.npz.x'
        f".other.npz.{host}.{dead}.0123abcd.tmp": ("kept", old),
        f".ckpt.npz.{host}.{dead}.notes.tmp": ("kept", old),
        "ckpt.npz.tmp": ("kept", old),
    }
    for name, (_, mtime) in files.items():
        (tmp_path / name).write_bytes(b"partial")
        if mtime is not None:
            os.utime(tmp_path / name, (mtime, mtime))
    model = make_model(seed=7)
    checkpoint.save(tmp_path / "ckpt.npz", model, step=3)
    left = set(os.listdir(tmp_path))
    assert left == {"ckpt.npz"} | {name for name, (fate, _) in files.items() if fate == "kept"}
    assert checkpoint.load(tmp_path / "ckpt.npz", make_model(seed=8)) == {"step": 3}


class _Sink:
    """Takes any state_dict (the killed script's model has other entries than make_model's)."""

    def load_state_dict(self, state_dict, strict=True):
        self.state = state_dict


def _array_data_offset(path, member):
    """Byte offset of an array's data inside the .npz (zip local header + .npy header)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member + ".npy")
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len + 128  # npy v1 header: 128 bytes


def _truncate(fraction):
    def damage(path):
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * fraction)])
    return damage


def _flip_weight_byte(path):
    data = bytearray(path.read_bytes())
    data[_array_data_offset(path, "model/0.weight") + 5] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_meta(path):
    np.savez(path, **{"model/weight": np.zeros(3)})


def _bad_meta(path):
    np.savez(path, __meta__=np.frombuffer(json.dumps({"format": "other"}).encode(), np.uint8))


@pytest.mark.parametrize("damage, reason", [
    (_truncate(0.5), "BadZipFile"),
    (_truncate(0.99), "BadZipFile"),
    (_truncate(0.0), "the file is empty"),
    (_flip_weight_byte, "Bad CRC-32"),
    (lambda path: path.write_text("not a checkpoint\n"), "does not start like an .npz"),
    (_drop_meta, "no '__meta__' entry"),
    (_bad_meta, "does not describe a hpcgrad-checkpoint"),
], ids=["half", "tail", "empty", "flipped-byte", "text", "no-meta", "foreign-meta"])
def test_corrupt_file_raises_checkpoint_error(tmp_path, damage, reason):
    path = tmp_path / "ckpt.npz"
    model = make_model(seed=1)
    checkpoint.save(path, model, optimizer=SGD(model.parameters(), momentum=0.5), step=3)
    damage(path)
    model = make_model(seed=2)
    before = _state(model)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, model)
    message = str(info.value)
    assert str(path) in message and reason in message
    assert "nothing was restored" in message and "previous checkpoint" in message
    _assert_states_equal(before, _state(model))


def test_load_checks_optimizer(tmp_path):
    path = tmp_path / "ckpt.npz"
    model = make_model(seed=1)
    checkpoint.save(path, model, SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="holds SGD state, but the optimizer given is Adam"):
        checkpoint.load(path, model, Adam(model.parameters()))
    checkpoint.save(path, model)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        checkpoint.load(path, model, SGD(model.parameters()))


@pytest.mark.parametrize("damage, reason", [
    (_truncate(0.5), "BadZipFile"),
    (_flip_weight_byte, "Bad CRC-32"),
    (_drop_meta, "no '__meta__' entry"),
], ids=["half", "flipped-byte", "no-meta"])
def test_read_extra_checks_the_whole_file(tmp_path, damage, reason):
    """What a job reads to decide whether it can resume (issue 26): reading only __meta__ gave
    the extra values of a file whose weights were bit-flipped, and raw BadZipFile/KeyError."""
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, make_model(seed=1), step=3, epoch=1)
    assert checkpoint.read_extra(path) == {"step": 3, "epoch": 1}
    damage(path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_extra(path)
    assert str(path) in str(info.value) and reason in str(info.value)
    assert "move this one away and start afresh" in str(info.value)
