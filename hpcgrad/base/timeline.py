"""HPCGRAD_TIMELINE=path: each rank's spans (forward, backward, buckets, all-reduce...) in Chrome trace format.

Note [Timeline]
    Horovod's HOROVOD_TIMELINE, for hpcgrad: with HPCGRAD_TIMELINE=PATH set, every rank records
    spans (``with TIMELINE.span("backward"):``, or ``begin``/``end`` where a span starts and ends
    in different places, as a bucket's all-reduce) and instants, and writes them to
    ``PATH.rank<R>`` when the process ends (or at ``TIMELINE.save()``). ``merge(PATH)`` (and
    ``python -m hpcgrad.timeline PATH``) joins the per-rank files into PATH, one process row per
    rank, which chrome://tracing and https://ui.perfetto.dev open. Times are microseconds of
    ``time.time()``, so ranks on one node line up; across nodes they are as close as the clocks.
    Off (the default) every call is one attribute test and returns; nothing is recorded.
"""

import argparse
import atexit
import glob
import json
import os
import sys
import threading
import time

from hpcgrad.base import config

TIMELINE_ENV = "HPCGRAD_TIMELINE"


class _NoSpan:
    """What ``span`` returns when the timeline is off: a context manager that does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


class _Span:
    __slots__ = ("_timeline", "_name", "_category", "_args")

    def __init__(self, timeline, name, category, args):
        self._timeline, self._name, self._category, self._args = timeline, name, category, args

    def __enter__(self):
        self._timeline.begin(self._name, self._category, **self._args)
        return self

    def __exit__(self, *exc):
        self._timeline.end(self._name, self._category)
        return False


class Timeline:
    """One rank's events; ``enabled`` only when a path is set (env HPCGRAD_TIMELINE)."""

    def __init__(self, path=None, rank=None):
        self.path = path
        self.enabled = bool(path)
        self.rank = rank
        self._events = []
        self._lock = threading.Lock()
        self._saved = False

    def _rank(self):
        if self.rank is None:
            # The launcher's variables: reading MPI's rank here would start MPI for a timeline.
            for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK"):
                if os.environ.get(name, "").isdigit():
                    self.rank = int(os.environ[name])
                    break
            else:
                self.rank = 0
        return self.rank

    def _add(self, phase, name, category, args, span_id=None):
        event = {"name": name, "cat": category, "ph": phase, "ts": time.time() * 1e6,
                 "pid": self._rank(), "tid": threading.get_ident() % 100000}
        if span_id is not None:
            event["id"] = span_id
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def begin(self, name, category="hpcgrad", **args):
        if self.enabled:
            self._add("B", name, category, args)

    def end(self, name, category="hpcgrad", **args):
        if self.enabled:
            self._add("E", name, category, args)

    def begin_async(self, name, category, span_id, **args):
        """Start a span that may overlap others on this thread (a bucket's all-reduce): Chrome's
        async events ("b"/"e" with an id), which viewers draw on a track of their own instead
        of cutting nested B/E slices short."""
        if self.enabled:
            self._add("b", name, category, args, span_id)

    def end_async(self, name, category, span_id, **args):
        if self.enabled:
            self._add("e", name, category, args, span_id)

    def instant(self, name, category="hpcgrad", **args):
        if self.enabled:
            self._add("i", name, category, args)

    def span(self, name, category="hpcgrad", **args):
        """``with TIMELINE.span("forward"):`` records the block as one span."""
        return _Span(self, name, category, args) if self.enabled else _NO_SPAN

    def events(self):
        with self._lock:
            return list(self._events)

    def save(self):
        """Write this rank's events to ``PATH.rank<R>`` (atomically); returns the file's path."""
        if not self.enabled:
            return None
        target = f"{self.path}.rank{self._rank()}"
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        temporary = f"{target}.tmp{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({"rank": self._rank(), "traceEvents": self.events()}, f)
        os.replace(temporary, target)
        self._saved = True
        return target


def merge(path):
    """Join ``path.rank*`` into ``path`` (Chrome trace JSON, one process row per rank); returns
    the number of ranks merged."""
    parts = sorted(glob.glob(f"{glob.escape(path)}.rank*"))
    parts = [p for p in parts if p.rpartition(".rank")[2].isdigit()]
    if not parts:
        raise FileNotFoundError(f"no per-rank timeline files {path}.rank<R>: run the job with "
                                f"{TIMELINE_ENV}={path} first")
    events = []
    for part in parts:
        with open(part, encoding="utf-8") as f:
            data = json.load(f)
        rank = data["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                       "args": {"sort_index": rank}})
        events.extend(data["traceEvents"])
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(temporary, path)
    return len(parts)


def finish(barrier, rank, say=print):
    """A job's last word on its timeline, on every rank, on every path that ends it normally
    (its last step, --max-steps, a preemption): this rank's part written, then, once every
    rank's is (``barrier``: the job's), rank 0 merges them and says where (``say``). Does
    nothing when no timeline is recorded. A job ended by an error writes its own part at exit
    (atexit) and merges nothing: the other ranks may never get here."""
    if not TIMELINE.enabled:
        return
    TIMELINE.save()
    barrier()
    if rank == 0:
        merge(TIMELINE.path)
        say(f"timeline: {TIMELINE.path} (open in https://ui.perfetto.dev)", flush=True)


TIMELINE = Timeline(config.raw(TIMELINE_ENV) or None)
if TIMELINE.enabled:
    atexit.register(TIMELINE.save)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hpcgrad.timeline",
                                     description="Merge the per-rank files of HPCGRAD_TIMELINE=PATH "
                                                 "into PATH (open it in https://ui.perfetto.dev).")
    parser.add_argument("path", help="the HPCGRAD_TIMELINE path the job ran with")
    args = parser.parse_args(argv)
    try:
        ranks = merge(args.path)
    except (FileNotFoundError, ValueError, KeyError) as error:
        print(f"hpcgrad.timeline: {error}", file=sys.stderr)
        return 2
    print(f"{args.path}: {ranks} ranks merged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
