"""Per-call cost of the flight recorder (Note [Flight recorder]) and the stall inspector, one process.

    python benchmarks/flight.py             # the figures quoted in docs/
    python benchmarks/flight.py --quick

- pair, hot: median ns per ``begin`` + ``end`` pair, in blocks of 1000 back-to-back pairs;
  beside it two empty method calls with the same arguments (what any hook costs in Python).
- pair, cold: one pair timed alone after a 4 MB array is rewritten (as after a transfer or a
  layer's compute: the interpreter's working set is evicted); the cost of reading the clock
  twice, measured the same way, is subtracted.
- all_reduce: ``comm.Allreduce`` of 4 KB at size 1 with and without begin/end around it, hot and
  cold, as ``benchmarks/comm.py --overhead`` times hpcgrad's own cost: the recorder's share of a
  call.
- stall inspector: the hot path writes nothing for it (its thread reads the ring); the pairs
  again with its thread running, and what the thread costs per poll (``RECORDER.latest()``
  with 4 groups, once a second by default).
Medians of the repetitions; nothing here is used by a test.
"""

import argparse
import statistics
import time

import numpy as np

from hpcgrad.comm.flight_recorder import FlightRecorder
from hpcgrad.comm.mpi import MPI
from hpcgrad.comm.stall import StallInspector

_clock = time.perf_counter_ns


class _Empty:
    def begin(self, group, seq, op, peer, array):
        return 0

    def end(self, slot, ok=True):
        pass


def hot_pairs(recorder, group, array, blocks, per_block=1000):
    """Median ns per begin+end pair over ``blocks`` blocks of back-to-back pairs."""
    begin, end = recorder.begin, recorder.end
    times = []
    for _ in range(blocks):
        t0 = _clock()
        for seq in range(per_block):
            end(begin(group, seq, "allreduce", None, array))
        times.append((_clock() - t0) / per_block)
    return statistics.median(times)


def cold_pairs(recorder, group, array, repeats, junk):
    """Median ns of one pair after evicting the caches, less the clock's own cost."""
    begin, end = recorder.begin, recorder.end
    pairs, clocks = [], []
    for seq in range(repeats):
        junk += 1
        t0 = _clock()
        end(begin(group, seq, "allreduce", None, array))
        pairs.append(_clock() - t0)
        junk += 1
        t0 = _clock()
        clocks.append(_clock() - t0)
    return statistics.median(pairs) - statistics.median(clocks)


def allreduce_costs(recorder, group, repeats, junk):
    """Median us of a 4 KB Allreduce (size 1), bare and with begin/end, hot and cold."""
    comm = MPI.COMM_WORLD
    buf = np.zeros(1024, np.float32)
    begin, end = recorder.begin, recorder.end

    def recorded(seq):
        slot = begin(group, seq, "allreduce", None, buf)
        comm.Allreduce(MPI.IN_PLACE, buf)
        end(slot)

    impls = {"bare": lambda seq: comm.Allreduce(MPI.IN_PLACE, buf), "recorded": recorded}
    out = {}
    for case in ("hot", "cold"):
        times = {name: [] for name in impls}
        for seq in range(repeats):
            for name, run in impls.items():
                if case == "cold":
                    junk += 1
                t0 = _clock()
                run(seq)
                times[name].append(_clock() - t0)
        out[case] = {name: statistics.median(t) / 1e3 for name, t in times.items()}
    return out


def latest_cost(recorder, repeats):
    """Median us of the stall inspector's per-poll read of this rank's latest calls."""
    times = []
    for _ in range(repeats):
        t0 = _clock()
        recorder.latest()
        times.append(_clock() - t0)
    return statistics.median(times) / 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args(argv)
    blocks, repeats = (20, 500) if args.quick else (200, 5000)
    if MPI.COMM_WORLD.Get_size() != 1:
        raise SystemExit("benchmarks/flight.py runs in one process: python benchmarks/flight.py")
    array = np.zeros(1024, np.float32)
    junk = np.zeros(1 << 20, np.float32)  # 4 MB
    recorder = FlightRecorder(2000)
    groups = [recorder.register_group([0], name) for name in ("default", "ddp", "a", "b")]
    off = FlightRecorder(0)
    off_group = off.register_group([0], "default")
    empty = _Empty()
    for r, g in ((recorder, groups[0]), (off, off_group), (empty, 0)):  # warm up
        hot_pairs(r, g, array, 5)
    print(f"flight recorder, per begin+end pair (medians; {blocks} blocks of 1000 hot, "
          f"{repeats} cold):")
    rows = [("recorder (2000 entries)", recorder, groups[0]),
            ("HPCGRAD_FLIGHT_RECORDER=0", off, off_group),
            ("two empty method calls", empty, 0)]
    for name, r, g in rows:
        hot = hot_pairs(r, g, array, blocks)
        cold = cold_pairs(r, g, array, repeats, junk)
        print(f"  {name:28s} hot {hot:6.0f} ns   cold {cold:6.0f} ns")
    inspector = StallInspector(MPI.COMM_WORLD.Dup(), 60.0, recorder)  # its thread polls
    hot = hot_pairs(recorder, groups[0], array, blocks)
    cold = cold_pairs(recorder, groups[0], array, repeats, junk)
    inspector.stop()
    print(f"  {'recorder + stall inspector':28s} hot {hot:6.0f} ns   cold {cold:6.0f} ns")
    costs = allreduce_costs(recorder, groups[0], repeats, junk)
    for case, med in costs.items():
        print(f"  4 KB comm.Allreduce, {case:4s}: {med['bare']:6.2f} us bare, "
              f"{med['recorded']:6.2f} us with begin/end: +{med['recorded'] - med['bare']:.2f} us")
    for g in groups:  # every group has a latest call
        recorder.end(recorder.begin(g, 1, "allreduce", None, array))
    print(f"stall inspector: 0 ns on the hot path; its thread reads the latest calls in "
          f"{latest_cost(recorder, repeats // 5):.1f} us per poll (once a second)")


if __name__ == "__main__":
    main()
