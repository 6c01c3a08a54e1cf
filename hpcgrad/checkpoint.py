"""Checkpoints: atomic save/load of model, optimizer and RNG state in one .npz file (no pickle).

File layout (a numpy ``.npz``, i.e. a zip of ``.npy`` arrays):

- ``model/<name>``        each entry of ``model.state_dict()``
- ``optim/<index>/<key>`` each array of the optimizer state (``index`` as in its state_dict)
- ``__meta__``            uint8 bytes of UTF-8 JSON: format and version, the ``extra`` values
  (step, epoch, ...), the optimizer's param_groups and scalar state, the RNG states of
  hpcgrad's global generator and numpy's legacy global one, and the list of array names.

Loading uses ``allow_pickle=False``: a checkpoint holds data only, never code.

Note [Atomic checkpoint replace]
    ``save`` writes a temporary file in the target's directory, flushes and fsyncs it, renames
    it over the target with ``os.replace`` (atomic on POSIX within one file system), then fsyncs
    the directory so the rename itself survives a crash. A save killed at any point leaves the
    previous checkpoint whole; at worst a ``.<name>.<host>.<pid>.<token>.tmp`` file stays behind
    until the next save of the same checkpoint removes it (Note [Stale temporaries]).
    ``save`` and ``load`` are not collective: in a multi-rank job call ``save``
    on one rank only (``if rank == 0: save(...)``), and have the others wait at a barrier before
    they ``load`` the file. Temporary names are unique per process, so ranks saving their own
    files into one directory do not collide.

Note [Stale temporaries]
    A save killed mid-way (SIGKILL, preemption, a node lost) leaves its full-size temporary:
    20 killed saves of a 10 MB model left 221 MB. Each save first removes the temporaries of
    the same checkpoint that no live save can still be writing: those named exactly as ours
    (``.<name>.<host>.<pid>.<8 hex>.tmp``, never another file) whose writer was on this host
    and is gone (no process ``pid``), or, whatever the host (a job restarted on other nodes
    of a shared file system), that nobody has modified for ``ABANDONED_AFTER`` seconds: a
    live save writes its temporary continuously and renames it seconds after the last write.
    A temporary of another host younger than that, or of a live pid here, stays.
"""

import json
import os
import re
import secrets
import socket
import time
import zipfile
from collections import OrderedDict

import numpy as np

from . import backend
from .creation import default_generator
from .tensor import Tensor

FORMAT = "hpcgrad-checkpoint"
VERSION = 1
_META = "__meta__"
ABANDONED_AFTER = 3600.0  # seconds unmodified after which any temporary of ours is stale
# The host as it appears in temporary names: no dot (so a name parses one way), nothing odd.
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"


class CheckpointError(RuntimeError):
    """A checkpoint file could not be written or read (truncated, corrupt, or not a checkpoint)."""


def save(path, model, optimizer=None, **extra):
    """Write model, optimizer and RNG state, plus the JSON-able ``extra`` values, to ``path``.

    Atomic (Note [Atomic checkpoint replace]): an existing file at ``path`` is replaced only by a
    complete, synced new one. ``extra`` values must be JSON-serializable (numbers, strings,
    lists, dicts); they come back from ``load`` as JSON gives them (tuples as lists).
    Not collective: call it on one rank.
    """
    path = os.fspath(path)
    arrays = OrderedDict()
    model_keys = []
    for name, value in model.state_dict().items():
        arrays[f"model/{name}"] = _host_array(value)
        model_keys.append(name)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "extra": extra,
        "model": {"class": type(model).__name__, "keys": model_keys},
        "optimizer": None if optimizer is None else _pack_optimizer(optimizer, arrays),
        "rng": _rng_states(),
    }
    meta["arrays"] = list(arrays)
    try:
        text = json.dumps(meta)
    except (TypeError, ValueError) as exc:
        bad = _first_non_json(extra)
        what = f"extra value {bad!r}" if bad else "optimizer param_groups"
        raise TypeError(f"checkpoint.save({path!r}): {what} is not JSON-serializable ({exc}); "
                        f"pass numbers, strings, lists or dicts (convert arrays with .tolist())") \
            from exc
    arrays[_META] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    _atomic_write(path, arrays)


def load(path, model, optimizer=None):
    """Restore ``model`` (via ``load_state_dict``), ``optimizer`` if given, and the global RNG
    states from ``path``; return the ``extra`` dict given to ``save``.

    The whole file is read and checked before anything is restored; a truncated or corrupt file
    raises CheckpointError. An error from ``model.load_state_dict`` or
    ``optimizer.load_state_dict`` (a different model) is raised as it comes, possibly after the
    model was restored. Not collective.
    """
    path = os.fspath(path)
    meta, arrays = _read(path)
    state = OrderedDict((name, Tensor(arrays[f"model/{name}"])) for name in meta["model"]["keys"])
    if optimizer is not None:
        packed = meta["optimizer"]
        if packed is None:
            raise ValueError(f"checkpoint {path!r} holds no optimizer state (saved without "
                             f"optimizer=); call load without an optimizer")
        if packed["class"] != type(optimizer).__name__:
            raise ValueError(f"checkpoint {path!r} holds {packed['class']} state, but the "
                             f"optimizer given is {type(optimizer).__name__}")
    model.load_state_dict(state)
    if optimizer is not None:
        optimizer.load_state_dict(_unpack_optimizer(meta["optimizer"], arrays))
    _set_rng_states(meta["rng"])
    return meta["extra"]


# --- writing ---------------------------------------------------------------------------------
def _host_array(value):
    array = value.data if isinstance(value, Tensor) else value
    if backend.is_gpu_array(array):
        return backend.to_device(array, backend.CPU)
    return np.asarray(array)


def _pack_optimizer(optimizer, arrays):
    """param_groups and scalar state as JSON; each state array into ``arrays`` under its name."""
    sd = optimizer.state_dict()
    state = {}
    for index, entries in sd["state"].items():
        packed = {}
        for key, value in entries.items():
            if isinstance(value, (Tensor, np.ndarray)) or backend.is_gpu_array(value):
                name = f"optim/{index}/{key}"
                arrays[name] = _host_array(value)
                packed[key] = {"array": name}
            else:
                packed[key] = {"value": value.item() if isinstance(value, np.generic) else value}
        state[str(index)] = packed
    return {"class": type(optimizer).__name__, "param_groups": sd["param_groups"], "state": state}


def _rng_states():
    legacy = np.random.get_state(legacy=False)
    legacy["state"]["key"] = legacy["state"]["key"].tolist()
    return {"hpcgrad": default_generator().bit_generator.state, "numpy": legacy}


def _first_non_json(extra):
    for key, value in extra.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return key
    return None


def _atomic_write(path, arrays):
    """Note [Atomic checkpoint replace]."""
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{_HOST}.{os.getpid()}."
                                  f"{secrets.token_hex(4)}.tmp")
    try:
        # os.open with 0o666 lets the umask decide the mode, as for a plain open(); O_EXCL
        # guarantees the name is ours.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise CheckpointError(f"could not write checkpoint {path!r}: {exc}; any previous "
                                  f"checkpoint at that path is untouched") from exc
        raise
    _fsync_directory(directory)


def remove_stale_temporaries(path):
    """Delete the temporaries of checkpoint ``path`` that interrupted saves left behind (Note
    [Stale temporaries]); return the paths removed. Never raises for a file it cannot remove."""
    directory = os.path.dirname(os.path.abspath(path))
    base = re.escape(os.path.basename(path))
    ours = re.compile(rf"\.{base}\.(?:(?P<host>[A-Za-z0-9_-]+)\.)?(?P<pid>\d+)\.[0-9a-f]{{8}}\.tmp")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed, now = [], time.time()
    for name in names:
        match = ours.fullmatch(name)
        if match is None:
            continue
        tmp = os.path.join(directory, name)
        try:
            age = now - os.stat(tmp, follow_symlinks=False).st_mtime
        except OSError:
            continue  # renamed or removed meanwhile by its writer
        writer_gone = match["host"] == _HOST and not _process_alive(int(match["pid"]))
        if writer_gone or age > ABANDONED_AFTER:
            try:
                os.unlink(tmp)
                removed.append(tmp)
            except OSError:
                pass
    return removed


def _process_alive(pid):
    if pid == os.getpid():
        return True  # another thread of ours may be saving the same checkpoint
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def _fsync_directory(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory
    finally:
        os.close(fd)


# --- reading ---------------------------------------------------------------------------------
def _read(path):
    """(meta, arrays) with every array read in full, so zip CRCs are checked before any restore."""
    def broken(what):
        return CheckpointError(
            f"checkpoint {path!r} is unreadable: {what}. The file is truncated, corrupt or not an "
            f"hpcgrad checkpoint; nothing was restored. save() replaces files atomically: an "
            f"interrupted save leaves the previous checkpoint in place (plus at most a partial "
            f"'.{os.path.basename(path)}.*.tmp' file, which the next save removes), never a "
            f"file like this.")

    try:
        with open(path, "rb") as f:
            head = f.read(4)
        if len(head) == 0:
            raise broken("the file is empty")
        if head != b"PK\x03\x04":  # np.load would guess another format (.npy, pickle)
            raise broken(f"it does not start like an .npz (zip) archive (first bytes {head!r})")
        with np.load(path, allow_pickle=False) as npz:
            if _META not in npz.files:
                raise broken(f"no {_META!r} entry")
            meta = json.loads(npz[_META].tobytes().decode("utf-8"))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise broken(f"{_META!r} does not describe a {FORMAT}")
            absent = [key for key in ("extra", "model", "optimizer", "rng", "arrays")
                      if key not in meta]
            if absent:
                raise broken(f"{_META!r} lacks {absent}")
            if meta.get("version") != VERSION:
                raise CheckpointError(f"checkpoint {path!r} has format version "
                                      f"{meta.get('version')}, this hpcgrad reads version "
                                      f"{VERSION}; use the hpcgrad that wrote it")
            missing = [name for name in meta["arrays"] if name not in npz.files]
            if missing:
                raise broken(f"arrays {missing} listed in the metadata are missing")
            arrays = {name: npz[name] for name in meta["arrays"]}
    except FileNotFoundError:
        raise
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, UnicodeDecodeError) as exc:
        raise broken(f"{type(exc).__name__}: {exc}") from exc
    return meta, arrays


def _unpack_optimizer(packed, arrays):
    state = {}
    for index, entries in packed["state"].items():
        state[int(index)] = {key: arrays[item["array"]] if "array" in item else item["value"]
                             for key, item in entries.items()}
    return {"state": state, "param_groups": packed["param_groups"]}


def _set_rng_states(states):
    default_generator().bit_generator.state = states["hpcgrad"]
    legacy = dict(states["numpy"])
    legacy["state"] = dict(legacy["state"], key=np.asarray(legacy["state"]["key"], np.uint32))
    np.random.set_state(legacy)
