"""``python -m hpcgrad.flight DIR``: merge the ranks' flight records and name the rank that diverged.

Each rank's ``flight_rank{R}.json`` (Note [Flight recorder] in hpcgrad/comm/flight_recorder.py)
lists its last communication calls. Collectives are aligned per group by their number on each
rank (the n-th collective a rank called on that group); the first number where the ranks
disagree is reported, in this order of evidence:

- mismatch: the ranks called different operations, counts or dtypes as that collective;
- missing:  some ranks posted it, others never did (they are behind, or skipped one);
- stuck:    it completed on some ranks but not on others (those are stuck in it).

A group whose last collective is posted and incomplete on every rank alike is reported as in
progress: the ranks agree, so the trouble lies elsewhere (another group, point to point, MPI).

Every record holds its job's world size, so a rank without a record (it exited, was killed
before it could write one, or wrote to another HPCGRAD_FLIGHT_DIR) is named. Records from some
ranks only are partial evidence: the missing rank may be the one that diverged, so the tool
then never says the records agree.

Every record also names its job (Note [Job ids] in hpcgrad/comm/flight_recorder.py): records of
different jobs in one directory (a later run that left fewer records than an earlier one) are
refused, not merged into a divergence that never happened; ``--job`` picks one job's records.

Exit status: 0 when every rank's record is there and they agree, 1 when a divergence is found
(whether or not some records are missing), 2 on bad input (no dumps, unreadable or malformed
ones), 3 when the records present show no divergence but some ranks' records are missing.
``--json`` prints the findings as JSON ("consistent" is true only for status 0). Reads files
only: no MPI.
"""

import argparse
import glob
import json
import os
import re
import sys
import time

_DUMP = re.compile(r"flight_rank(\d+)\.json$")


class BadInput(Exception):
    """The directory holds no usable flight records."""


def load(directory):
    """{rank: dump} from ``directory``; raises BadInput saying what is wrong."""
    if not os.path.isdir(directory):
        raise BadInput(f"{directory!r} is not a directory (give the HPCGRAD_FLIGHT_DIR the ranks "
                       f"wrote to, default ./hpcgrad-flight)")
    paths = sorted(p for p in glob.glob(os.path.join(directory, "flight_rank*.json"))
                   if _DUMP.search(p))
    if not paths:
        raise BadInput(f"no flight_rank*.json in {directory!r}: no rank wrote a flight record "
                       f"there (check HPCGRAD_FLIGHT_DIR, and HPCGRAD_FLIGHT_RECORDER is not 0)")
    dumps = {}
    for path in paths:
        try:
            with open(path) as f:
                dump = json.load(f)
            rank = int(dump["rank"])
            for key in ("world_size", "reason", "time", "groups", "entries"):
                dump[key]  # a KeyError names the missing field
            for entry in dump["entries"]:
                for key in ("group", "collective", "op", "peer", "count", "dtype", "state",
                            "start"):
                    entry[key]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{path}: not a flight record ({type(exc).__name__}: {exc})") from None
        if rank in dumps:
            raise BadInput(f"two records for rank {rank} in {directory!r}")
        dumps[rank] = dump
    return dumps


def _jobs(dumps):
    """{job id: [ranks]} of the records that name an agreed job."""
    jobs = {}
    for rank, dump in sorted(dumps.items()):
        if dump.get("job_agreed"):
            jobs.setdefault(dump.get("job"), []).append(rank)
    return jobs


def select_job(dumps, job=None):
    """The records of one job: all of them when they name one (or none), else those of ``job``;
    raises BadInput naming the jobs found when the records mix jobs and ``job`` picks none."""
    jobs = _jobs(dumps)
    if job is None and len(jobs) <= 1:
        return dumps
    if job is not None and job in jobs:
        return {rank: dump for rank, dump in dumps.items()
                if dump.get("job") == job or not dump.get("job_agreed")}
    found = "; ".join(
        f"{name!r}: {_ranks(ranks)}, written at "
        f"{time.strftime('%H:%M:%S', time.localtime(max(dumps[r]['time'] for r in ranks)))}"
        for name, ranks in jobs.items())
    asked = f"no record of job {job!r}" if job is not None else "records of different jobs"
    raise BadInput(f"{asked} here: {found}. Merging them would report a divergence that never "
                   f"happened: pick one with --job '<id>', or give each run its own "
                   f"HPCGRAD_FLIGHT_DIR (and remove the stale records)")


def _ranks(ranks):
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _group_label(gid, groups):
    """'group DDP(default)', or 'group 3' for a group registered without a name: the words of
    the stall inspector's group_label (Note [Group names] in hpcgrad/comm/stall.py)."""
    if gid not in groups:
        return f"group {gid} (not in any record's group list)"
    name = groups[gid]["name"]
    if name == str(gid):
        return f"group {gid}"
    shared = sum(1 for other in groups.values() if other["name"] == name) > 1
    return f"group {name}" + (f" [id {gid}]" if shared else "")


def describe(entry, groups=None):
    """'allreduce #5 (4 x float32) on group default' or 'recv from rank 1 (...) on group 3'."""
    if entry["peer"] is None:
        what = f"{entry['op']} #{entry['collective']}"
    else:
        what = f"{entry['op']} {'to' if entry['op'] == 'send' else 'from'} rank {entry['peer']}"
    return f"{what} ({entry['count']} x {entry['dtype']}) on {_group_label(entry['group'], groups or {})}"


def _state(entry, dump):
    """'complete', 'failed after 2.0 s' or 'posted 2.0 s before its dump'."""
    if entry["state"] == "posted":
        return f"posted {dump['time'] - entry['start']:.1f} s before its dump, never completed"
    if entry["state"] == "failed":
        return f"failed after {(entry['end'] or dump['time']) - entry['start']:.1f} s"
    return "complete"


def _signature(entry):
    return (entry["op"], entry["count"], entry["dtype"])


def _sig_text(sig):
    return f"{sig[0]} ({sig[1]} x {sig[2]})"


def _groups(dumps):
    """{group id: {"name", "ranks"}} from the records (the first record naming a group wins)."""
    groups = {}
    for rank in sorted(dumps):
        for group in dumps[rank]["groups"]:
            groups.setdefault(int(group["id"]), {"name": str(group["name"]),
                                                 "ranks": [int(r) for r in group["ranks"]]})
    return groups


def _divergence(gid, group, dumps):
    """The first divergent collective of group ``gid``, or None."""
    colls, first, last = {}, {}, {}
    for rank in group["ranks"]:
        dump = dumps.get(rank)
        if dump is None:
            continue
        mine = {e["collective"]: e for e in dump["entries"]
                if e["group"] == gid and e["peer"] is None}
        complete_ring = dump.get("recorded", 0) <= dump.get("capacity", 0)
        if not mine and not complete_ring:
            continue  # its ring lost every call of this group: nothing to compare
        colls[rank] = mine
        first[rank] = 1 if complete_ring or not mine else min(mine)
        last[rank] = max(mine) if mine else 0
    if len(colls) < 1:
        return None
    start, stop = max(first.values()), max(last.values())
    for number in range(start, stop + 1):
        have = {r: c[number] for r, c in colls.items() if number in c}
        if not have:
            continue  # lost from every ring (a call reserved but not yet stored at the dump)
        lacking = sorted(r for r in colls if number > last[r])
        found = {"group": gid, "collective": number, "ranks": sorted(colls),
                 "calls": {r: have[r] for r in sorted(have)}}
        sigs = {}
        for rank, entry in have.items():
            sigs.setdefault(_signature(entry), []).append(rank)
        if len(sigs) > 1:
            # The odd ones out: every signature group but the largest (ties: the one with
            # the lowest rank is taken as the norm).
            norm = max(sigs.values(), key=lambda rs: (len(rs), -min(rs)))
            found.update(kind="mismatch", diverged=sorted(r for rs in sigs.values()
                                                          if rs is not norm for r in rs),
                         signatures={_sig_text(s): sorted(rs) for s, rs in sigs.items()})
            return found
        if lacking:
            found.update(kind="missing", diverged=lacking, posted=sorted(have))
            return found
        done = sorted(r for r, e in have.items() if e["state"] == "complete")
        if done and len(done) < len(have):
            found.update(kind="stuck", diverged=sorted(set(have) - set(done)), completed=done)
            return found
        if not done and number == stop:  # every rank in the same call: they agree on it
            found.update(kind="in progress", diverged=[])
            return found
    return None


def _last_collective(dump, gid):
    calls = [e for e in dump["entries"] if e["group"] == gid and e["peer"] is None]
    return calls[-1] if calls else None


def analyze(dumps):
    """The findings as a dict (what ``--json`` prints)."""
    groups = _groups(dumps)
    world = max(int(d["world_size"]) for d in dumps.values())
    found = [d for gid in sorted(groups) if (d := _divergence(gid, groups[gid], dumps))]
    divergences = [d for d in found if d["diverged"]]
    in_progress = [d for d in found if not d["diverged"]]

    def when(found):  # the earliest start of the divergent call on any rank
        starts = [e["start"] for e in found["calls"].values()]
        return min(starts) if starts else float("inf")

    first = min(divergences, key=when) if divergences else None
    ranks = {}
    for rank, dump in sorted(dumps.items()):
        entries = dump["entries"]
        ranks[rank] = {"reason": dump["reason"], "host": dump.get("host"), "pid": dump.get("pid"),
                       "last": entries[-1] if entries else None,
                       "pending": [e for e in entries if e["state"] == "posted"],
                       "time": dump["time"], "events": dump.get("events", [])}
    missing = [r for r in range(world) if r not in dumps]
    jobs = _jobs(dumps)
    return {"directory_ranks": sorted(dumps), "world_size": world,
            "job": next(iter(jobs)) if len(jobs) == 1 else None,
            "world_sizes": {str(r): int(d["world_size"]) for r, d in sorted(dumps.items())},
            "missing_dumps": missing, "complete": not missing,
            "groups": {str(g): v for g, v in groups.items()},
            "consistent": not divergences and not missing, "first": first,
            "divergences": divergences,
            "in_progress": in_progress,
            "ranks": {str(r): v for r, v in ranks.items()}}


def _explain(found, dumps, groups):
    """Plain sentences for one divergence."""
    number, gid = found["collective"], found["group"]
    where = f"collective #{number} of {_group_label(gid, groups)}"
    lines = []
    if found["kind"] == "mismatch":
        parts = "; ".join(f"{_ranks(rs)} called {sig}" for sig, rs in found["signatures"].items())
        lines.append(f"{_ranks(found['diverged'])} diverged at {where}: the ranks called "
                     f"different operations or sizes there: {parts}.")
    elif found["kind"] == "missing":
        call = found["calls"][found["posted"][0]]
        lines.append(f"{_ranks(found['diverged'])} diverged at {where}: "
                     f"{_ranks(found['posted'])} posted {call['op']} #{number} ({call['count']} x "
                     f"{call['dtype']}); {_ranks(found['diverged'])} never did.")
        for rank in found["diverged"]:
            last = _last_collective(dumps[rank], gid)
            if last is not None:
                lines.append(f"  rank {rank}'s last collective on {_group_label(gid, groups)}: "
                             f"{describe(last, groups)}, {_state(last, dumps[rank])}")
    else:
        call = found["calls"][found["diverged"][0]]
        lines.append(f"{_ranks(found['diverged'])} diverged at {where}: {call['op']} #{number} "
                     f"({call['count']} x {call['dtype']}) completed on "
                     f"{_ranks(found['completed'])} but not on {_ranks(found['diverged'])}.")
        for rank in found["diverged"]:
            entry = found["calls"][rank]
            lines.append(f"  rank {rank}: {describe(entry, groups)}, {_state(entry, dumps[rank])}")
    return lines


def report(findings, dumps):
    """The findings in plain words."""
    groups = {int(g): v for g, v in findings["groups"].items()}
    world = findings["world_size"]
    missing = findings["missing_dumps"]
    job = f", job {findings['job']!r}" if findings["job"] else ""
    lines = [f"Flight records of {_ranks(findings['directory_ranks'])} (world size {world}{job})."]
    sizes = sorted(set(findings["world_sizes"].values()))
    if len(sizes) > 1:
        on = {size: [int(r) for r, n in findings["world_sizes"].items() if n == size]
              for size in sizes}
        said = "; ".join(f"{size} on {_ranks(ranks)}" for size, ranks in on.items())
        lines.append(f"The records disagree on the world size ({said}): some are from another "
                     f"run; give each run its own HPCGRAD_FLIGHT_DIR.")
    early = [int(r) for r, d in sorted(dumps.items()) if not d.get("job_agreed")]
    if early and len(early) < len(dumps):
        lines.append(f"{_ranks(early)} wrote {'its record' if len(early) == 1 else 'their records'}"
                     f" before the ranks agreed on a job id (at start-up): nothing says "
                     f"{'it is' if len(early) == 1 else 'they are'} this job's.")
    if missing:
        they = "it" if len(missing) == 1 else "they"
        lines.append(f"MISSING: no record from {_ranks(missing)} of the {world} ranks (a rank "
                     f"that exited, was killed before writing one -- an abort kills the others "
                     f"first -- or wrote to another HPCGRAD_FLIGHT_DIR); what {they} did is "
                     f"unknown, and {they} {'is' if they == 'it' else 'are'} left out below.")
    first = findings["first"]
    if first is None and missing:
        lines.append(f"No divergence among the records of {_ranks(findings['directory_ranks'])}, "
                     f"but this is partial evidence, not agreement: {_ranks(missing)} may be "
                     f"where the job diverged (look at {'its' if they == 'it' else 'their'} own "
                     f"output, or send every rank SIGUSR2 while the job still runs).")
    elif first is None:
        lines.append("The records agree: every group's collectives match on every rank.")
    else:
        lines.append("FIRST DIVERGENCE: " + _explain(first, dumps, groups)[0])
        lines += _explain(first, dumps, groups)[1:]
        for other in findings["divergences"]:
            if other is not first:
                lines.append("Also: " + _explain(other, dumps, groups)[0])
                lines += _explain(other, dumps, groups)[1:]
    for found in findings["in_progress"]:
        call = next(iter(found["calls"].values()))
        label = _group_label(found["group"], groups)
        what = f"{call['op']} #{found['collective']} ({call['count']} x {call['dtype']})"
        absent = [r for r in groups[found["group"]]["ranks"] if r in missing]
        if absent:
            lines.append(f"Every rank of {label} with a record ({_ranks(found['ranks'])}) was "
                         f"inside {what}, not completed, when it wrote it; {_ranks(absent)} "
                         f"left no record: it may never have reached {what}.")
            continue
        lines.append(f"Every rank of {label} was inside {what}, not completed, when it wrote "
                     f"its record: the ranks agree on it; if it never completes, look at the "
                     f"other groups, the point-to-point calls below, or MPI itself.")
    lines.append("What each rank was doing (its last call when it wrote its record):")
    for rank, info in sorted(findings["ranks"].items(), key=lambda kv: int(kv[0])):
        last = info["last"]
        doing = "no communication call recorded" if last is None else \
            f"{describe(last, groups)}, {_state(last, dumps[int(rank)])}"
        pending = len(info["pending"])
        more = f"; {pending} calls still posted" if pending > 1 else ""
        lines.append(f"  rank {rank}: {doing}{more} [record written on {info['reason']!r}]")
        for event in info.get("events", []):  # the job's own events before it (recoveries)
            details = ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("what", "time"))
            lines.append(f"    before it: {event['what']}" + (f" ({details})" if details else ""))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hpcgrad.flight",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the ranks wrote flight_rank*.json "
                        "(HPCGRAD_FLIGHT_DIR, default ./hpcgrad-flight)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--job", help="where the directory holds records of several jobs: the "
                        "job id whose records to merge (the error lists them)")
    args = parser.parse_args(argv)
    try:
        dumps = select_job(load(args.directory), args.job)
    except BadInput as exc:
        print(f"hpcgrad.flight: {exc}", file=sys.stderr)
        return 2
    findings = analyze(dumps)
    if args.json:
        print(json.dumps(findings, indent=1))
    else:
        print(report(findings, dumps))
    if findings["divergences"]:
        return 1
    return 0 if findings["complete"] else 3


if __name__ == "__main__":
    sys.exit(main())
