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

Note [Multi-part commit]
    A job whose ranks each hold a different part of the state (a pipeline's stages) cannot
    resume from per-rank files alone: a job killed inside one stage's save left the stages at
    steps 30/30/20, and nothing said which files belong together. ``save_parts`` is a two-phase
    commit, collective over a group:
    1. every rank writes its part, a checkpoint file of its own named by step and rank
       (Note [Atomic checkpoint replace]: temporary, fsync, rename, fsync the directory), and
       notes its size and sha256;
    2. all ranks gather every rank's outcome: if one failed, every rank raises and the last
       commit stands;
    3. rank 0 writes the manifest ``commit-<sequence>.json`` the same atomic way: the step, the
       world size and each part's file, size and sha256. Its rename is the commit point;
    4. rank 0 removes the manifests beyond the newest ``keep`` (after the new one is durable,
       so an older commit goes only once a newer one exists) and broadcasts the outcome; each
       rank then removes its own part files that no kept manifest names (older steps, a killed
       save's parts), so a directory private to each node works as well as a shared one.
    ``find_commit`` (collective) reads the manifests newest sequence first on rank 0 and
    broadcasts them; each rank checks its own part of each (present, size, sha256), the
    verdicts are gathered, and the newest commit that every rank confirms is taken; the newer
    ones it skipped come with the reason. Parts that no manifest names are never read. So a
    kill at any moment loses at most the steps since the last commit. Commits are ordered by
    sequence, not step: a run started afresh in a directory holding an older run's commits
    commits above them, and resume takes the newest run. ``_reached`` marks each phase, a seam
    where tests inject a kill (tests/scripts/ckpt26_kill.py).
"""

import hashlib
import json
import os
import re
import secrets
import socket
import time
import zipfile
from collections import OrderedDict

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor.creation import default_generator
from hpcgrad.tensor._tensor import Tensor

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
    Not collective: call it on one rank. Returns the file's (size in bytes, sha256 hex digest).
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
    return _atomic_write(path, lambda f: np.savez(f, **arrays))


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


def read_extra(path):
    """The ``extra`` values ``path`` was saved with, after the checks ``load`` makes (the
    whole file read; CheckpointError if truncated or corrupt), restoring nothing: what a job
    reads to decide whether it can resume from ``path`` at all. Not collective."""
    return _read(os.fspath(path))[0]["extra"]


# --- writing ---------------------------------------------------------------------------------
def _host_array(value):
    array = value.array if isinstance(value, Tensor) else value
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


def _atomic_write(path, write):
    """Note [Atomic checkpoint replace]: ``write(f)`` fills a temporary that replaces ``path``.
    Returns the file's (size, sha256 hex digest), read back from the synced temporary."""
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{_HOST}.{os.getpid()}."
                                  f"{secrets.token_hex(4)}.tmp")
    try:
        # os.open with 0o666 lets the umask decide the mode, as for a plain open(); O_EXCL
        # guarantees the name is ours.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        digest = _digest(tmp)  # of what is on disk (zip rewrites its headers: no hash-on-write)
        _reached("replace", path=path)
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
    return digest


def _digest(path):
    """(size, sha256 hex digest) of the file at ``path``."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _reached(phase, **where):
    """Nothing: the seam where tests stop a save at ``phase`` (Note [Multi-part commit])."""


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
            f"file like this. Resume from another checkpoint, or move this one away and start "
            f"afresh.")

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


# --- multi-part checkpoints (Note [Multi-part commit]) ---------------------------------------
MANIFEST_FORMAT = "hpcgrad-multipart-checkpoint"
_MANIFEST = re.compile(r"commit-(\d+)\.json")
_PART = re.compile(r"part-(\d+)-(\d+)of(\d+)\.npz")


def part_name(step, rank, world):
    return f"part-{step:09d}-{rank}of{world}.npz"


class Commit:
    """A complete multi-part checkpoint found by ``find_commit``: its manifest's ``name``,
    ``sequence``, ``step``, ``world_size``, ``parts`` (file, bytes, sha256 per rank), and
    ``skipped``: for each newer commit passed over, why (the same list on every rank)."""

    def __init__(self, directory, name, manifest, skipped=()):
        self.directory, self.name, self.manifest = directory, name, manifest
        self.sequence, self.step = manifest["sequence"], manifest["step"]
        self.world_size, self.parts = manifest["world_size"], manifest["parts"]
        self.skipped = list(skipped)

    def part_path(self, rank):
        return os.path.join(self.directory, self.parts[rank]["file"])

    def __repr__(self):
        return f"Commit({self.directory!r}, {self.name!r}, step={self.step})"


def _collectives(group):
    from hpcgrad import collectives as dist  # distributed imports this package: import late
    if group is None and not dist.is_initialized():
        raise RuntimeError("multi-part checkpoints are collective: call "
                           "hpcgrad.distributed.init_process_group() first (or pass group=)")
    return dist, dist.get_rank(group), dist.get_world_size(group)


def save_parts(directory, model, optimizer=None, *, step, group=None, keep=2, **extra):
    """Save this rank's part (``model``, ``optimizer``, ``extra`` as ``save`` takes them) of a
    multi-part checkpoint at ``step`` in ``directory``, and commit it once every rank's part
    is durable (Note [Multi-part commit]); return the committed ``Commit``'s name.

    Collective: every rank of ``group`` (default: the default group) calls it with the same
    ``step`` and ``keep`` (how many commits stay: the newest and ``keep - 1`` older ones, >= 1).
    Raises CheckpointError on every rank if any rank could not write its part or rank 0 the
    manifest; the last commit then stands.
    """
    if keep < 1:
        raise ValueError(f"save_parts: keep must be >= 1 (commits to keep), got {keep}")
    dist, rank, world = _collectives(group)
    directory = os.fspath(directory)
    name = part_name(step, rank, world)
    try:
        _reached("part", step=step, rank=rank, directory=directory)
        os.makedirs(directory, exist_ok=True)
        size, sha = save(os.path.join(directory, name), model, optimizer, step=step, **extra)
        mine = {"rank": rank, "file": name, "bytes": size, "sha256": sha}
    except (CheckpointError, OSError) as exc:
        mine = f"rank {rank} could not write its part {name}: {exc}"
    outcomes = [None] * world
    dist.all_gather_object(outcomes, mine, group=group)
    failed = [o for o in outcomes if isinstance(o, str)]
    result = [None, None]  # [manifest name, error]
    if rank == 0:
        if failed:
            result[1] = "; ".join(failed)
        else:
            _reached("parts-durable", step=step, rank=rank, directory=directory)
            try:
                result[0] = _commit(directory, step, outcomes)
                _reached("committed", step=step, rank=rank, directory=directory)
                result.append(_prune_manifests(directory, keep))
            except (CheckpointError, OSError) as exc:
                result[1] = f"rank 0 could not commit step {step}: {exc}"
    dist.broadcast_object_list(result, src=0, group=group)
    if result[1] is not None:
        raise CheckpointError(f"multi-part checkpoint of step {step} in {directory!r} not "
                              f"committed: {result[1]}. The last commit there is untouched.")
    _prune_parts(directory, rank, world, set(result[2]))
    return result[0]


def _manifests(directory):
    """[(sequence, manifest file name)] in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m[1]), name) for name in names if (m := _MANIFEST.fullmatch(name))]
    return sorted(found, reverse=True)


def _commit(directory, step, parts):
    existing = _manifests(directory)
    sequence = existing[0][0] + 1 if existing else 1
    name = f"commit-{sequence:08d}.json"
    manifest = {"format": MANIFEST_FORMAT, "version": VERSION, "sequence": sequence,
                "step": step, "world_size": len(parts), "parts": parts}
    text = json.dumps(manifest, indent=1).encode("utf-8")
    _atomic_write(os.path.join(directory, name), lambda f: f.write(text))
    return name


def _prune_manifests(directory, keep):
    """Remove the manifests beyond the newest ``keep``; return the part files the kept name."""
    kept = set()
    for index, (_, name) in enumerate(_manifests(directory)):
        path = os.path.join(directory, name)
        if index < keep:
            try:
                kept.update(part["file"] for part in _read_manifest(path)["parts"])
            except CheckpointError:
                pass
            continue
        try:
            os.unlink(path)
        except OSError:
            pass
    if len(kept):
        _fsync_directory(directory)
    return sorted(kept)


def _prune_parts(directory, rank, world, kept):
    """Remove this rank's part files that no kept manifest names; rank 0 also those of ranks
    beyond this world size (a run at another size)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _PART.fullmatch(name)
        if match is None or name in kept:
            continue
        owner = int(match[2])
        if owner == rank or (rank == 0 and owner >= world):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _read_manifest(path):
    def broken(what):
        return CheckpointError(f"manifest {path!r} is unreadable: {what}")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise broken(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise broken(f"not a {MANIFEST_FORMAT}")
    if manifest.get("version") != VERSION:
        raise broken(f"format version {manifest.get('version')}, this hpcgrad reads {VERSION}")
    try:
        parts = manifest["parts"]
        ok = (len(parts) == manifest["world_size"] and isinstance(manifest["step"], int)
              and all(p["rank"] == r and _PART.fullmatch(p["file"]) and p["bytes"] >= 0
                      and len(p["sha256"]) == 64 for r, p in enumerate(parts)))
    except (KeyError, TypeError) as exc:
        raise broken(f"lacks {exc}") from exc
    if not ok:
        raise broken("its parts do not list one file per rank")
    return manifest


def _check_part(directory, part):
    """Why this rank's ``part`` of a manifest cannot be used, or None."""
    path = os.path.join(directory, part["file"])
    try:
        size, sha = _digest(path)
    except FileNotFoundError:
        return f"its part {part['file']} is missing"
    except OSError as exc:
        return f"its part {part['file']} is unreadable ({exc.strerror})"
    if size != part["bytes"]:
        return f"its part {part['file']} has {size} bytes, the manifest says {part['bytes']}"
    if sha != part["sha256"]:
        return f"its part {part['file']} does not match the manifest's sha256 (corrupt or replaced)"
    return None


def find_commit(directory, group=None):
    """The newest complete multi-part checkpoint in ``directory`` (Note [Multi-part commit]), a
    ``Commit``, or None if the directory holds no manifest at all.

    Collective over ``group``: every rank checks its own part of each candidate; the newest
    commit that every rank confirms is returned on every rank, with the newer ones it skipped
    and why in ``.skipped``. A commit saved by another number of ranks is returned unchecked
    (``world_size`` tells; the caller refuses it or knows better). Raises CheckpointError
    (every rank) if there are manifests but none is complete.
    """
    dist, rank, world = _collectives(group)
    directory = os.fspath(directory)
    candidates = [None]
    if rank == 0:
        listed = []
        for _, name in _manifests(directory):
            try:
                listed.append((name, _read_manifest(os.path.join(directory, name))))
            except CheckpointError as exc:
                listed.append((name, str(exc)))
        candidates = [listed]
    dist.broadcast_object_list(candidates, src=0, group=group)
    candidates = candidates[0]
    if not candidates:
        return None
    verdicts = []
    for name, manifest in candidates:
        if isinstance(manifest, str) or manifest["world_size"] != world:
            verdicts.append(None)  # the same on every rank: decided below
        else:
            verdicts.append(_check_part(directory, manifest["parts"][rank]))
    everyone = [None] * world
    dist.all_gather_object(everyone, verdicts, group=group)
    skipped = []
    for index, (name, manifest) in enumerate(candidates):
        if isinstance(manifest, str):
            skipped.append(f"{name}: {manifest}")
            continue
        bad = [f"rank {r}: {v[index]}" for r, v in enumerate(everyone) if v[index] is not None]
        if not bad:
            return Commit(directory, name, manifest, skipped)
        skipped.append(f"{name} (step {manifest['step']}): {'; '.join(bad)}")
    raise CheckpointError(
        f"no complete multi-part checkpoint in {directory!r}: every commit there is damaged "
        f"({' | '.join(skipped)}). Restore the missing parts, or move the directory away and "
        f"start afresh")


def load_commit(commit, model, optimizer=None, group=None):
    """Restore this rank's part of ``commit`` (from ``find_commit``) through ``load``'s checks;
    return the ``extra`` values this rank saved with it. Not collective, but every rank of a
    job resuming calls it."""
    _, rank, world = _collectives(group)
    if commit.world_size != world:
        raise CheckpointError(f"{commit.name} in {commit.directory!r} was saved by "
                              f"{commit.world_size} ranks, this group has {world}; resume with "
                              f"{commit.world_size} ranks")
    return load(commit.part_path(rank), model, optimizer)


def newer_uncommitted_steps(directory, commit):
    """The steps of part files newer than ``commit`` that no manifest names (a save stopped
    before its commit): what resuming from ``commit`` leaves behind. Not collective."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    steps = {int(m[1]) for name in names if (m := _PART.fullmatch(name))}
    return sorted(s for s in steps if commit is None or s > commit.step)
