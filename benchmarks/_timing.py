"""Median-of-runs timing shared by the benchmarks.

Every repetition is timed on its own with ``time.perf_counter``; we report the median (the figure
to quote: robust to a noisy machine) and the minimum (the best the code can do here). As in
``timeit``, Python's cyclic garbage collector is switched off inside the timed region (and a full
collection runs before it), so a collection triggered by earlier allocations does not land in one
repetition at random (``pause_gc=False`` leaves it running, to see its share). Nothing here is
ever used in a test assertion.
"""

import gc
import statistics
import time
from contextlib import contextmanager


class Stats:
    """Times (seconds) of the timed repetitions of one quantity."""

    def __init__(self, times):
        self.times = list(times)

    @property
    def median(self):
        return statistics.median(self.times)

    @property
    def min(self):
        return min(self.times)

    def as_dict(self, scale=1.0):
        return {"median": self.median * scale, "min": self.min * scale,
                "runs": [t * scale for t in self.times]}


@contextmanager
def gc_paused(pause=True):
    """Collect now, then keep the cyclic GC off for the duration (restored afterwards).

    With ``pause=False`` only the collection happens: the GC stays as it was.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    if not pause:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def measure(run, setup=None, repeats=7, warmup=1, pause_gc=True):
    """Time ``run(state)`` where ``state = setup()`` is built fresh, untimed, for each repetition.

    ``warmup`` untimed repetitions come first. Returns a :class:`Stats` of ``repeats`` times.
    """
    times = []
    for i in range(warmup + repeats):
        with gc_paused(pause_gc):
            state = setup() if setup is not None else None
            t0 = time.perf_counter()
            run(state)
            elapsed = time.perf_counter() - t0
        del state  # freed (e.g. a long graph) outside the timed region
        if i >= warmup:
            times.append(elapsed)
    return Stats(times)


class PhaseClock:
    """Times consecutive phases of one step: ``clock.lap("forward")`` closes the current phase."""

    def __init__(self):
        self.laps = {}
        self._t = time.perf_counter()

    def lap(self, name):
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


def measure_phases(step, repeats=7, warmup=1, pause_gc=True):
    """Run ``step(clock)`` ``warmup + repeats`` times; ``step`` calls ``clock.lap(name)``.

    Returns ``{phase: Stats}`` plus ``"total"``: the per-step sum of the phases, so its median is
    the median step time (not the sum of the phase medians).
    """
    per_phase, totals = {}, []
    for i in range(warmup + repeats):
        with gc_paused(pause_gc):
            clock = PhaseClock()
            step(clock)
        if i < warmup:
            continue
        for name, t in clock.laps.items():
            per_phase.setdefault(name, []).append(t)
        totals.append(sum(clock.laps.values()))
    result = {name: Stats(ts) for name, ts in per_phase.items()}
    result["total"] = Stats(totals)
    return result
