"""The alpha-beta scaling model: validated against simulated-cluster runs, then DDP step time and efficiency predicted for 8 to 4,096 ranks.

The model is benchmarks/scaling_model.py (Note [The scaling model]): flat all-reduce step by
step over shared node links (MPICH's Rabenseifner, a ring), the hierarchical all-reduce, and a
DDP step whose buckets are reduced, in order, while backward runs. Weak scaling: each rank keeps
its batch, so efficiency = one-rank step / p-rank step.

    python benchmarks/scaling.py                         # projection table, stated fabrics
    python benchmarks/scaling.py --plot docs/scaling.png # + efficiency vs ranks (matplotlib)
    python benchmarks/scaling.py --validate block.json cyclic.json --unshaped unshaped.json
        # fit on simulated-cluster runs (benchmarks/cluster_allreduce.py --json), then model
        # vs measurement for every other layout and size, with the error per row
    python benchmarks/scaling.py --ddp-cluster 2x1-1gbit.json ...
        # the DDP step model vs DDP measured by benchmarks/ddp_cluster.py --json, every input
        # (compute split, bucket ready times, all-reduce cost) from the same run
    python benchmarks/scaling.py --fit-json comm.json    # alpha, beta from benchmarks/comm.py --json
    mpiexec -n 2 python benchmarks/scaling.py --fit      # measure Allreduce here, fit, predict

Validation (``--validate``): four fits, each on one layout, predict all the others:
  * in-node fabric: 1 node x 2 ranks, flat (MPICH's shared-memory all-reduce);
  * the hierarchical stages' fabric: 1 node x 2 ranks, hierarchical (MPICH's Ireduce + Ibcast:
    the in-node part of every hierarchical call);
  * inter-node link: 2 nodes x 1 rank, flat (one TCP stream through a shaped link);
  * the TCP stack's CPU cost per byte: 2 nodes x 1 rank on unshaped links (``--unshaped``):
    the part of the link's beta that stretches when ranks outnumber cores (``contended``).
Sizes >= 1 MB only: below, ``tc tbf``'s 256 KB burst lets a message through unshaped, and
latency on an oversubscribed machine is the scheduler's time slice, not the network's.

Projection inputs (change them with the options):
  * gradients, float32: the MLP 784-1024-1024-10 and the CNN of benchmarks/training.py
    (1,863,690 and 9,098 parameters), a ResNet-50-sized 25.5 M and a ResNet-101-sized 44.5 M;
  * compute per step on one rank: MLP 33.6 ms and CNN 12.8 ms (benchmarks/training.py, hpcgrad,
    one thread, batch 256 and 64, on this machine); ResNet-50 100 ms (a GPU at batch 32) and
    ResNet-101 490 ms (a P100 at batch 64, Horovod's setting): assumptions, not measurements;
    split forward 30%, backward 60%, optimizer 10%;
  * fabrics between nodes: InfiniBand 100 Gbit/s (alpha 1.5 us), 25 Gbit/s Ethernet (RoCE,
    alpha 5 us), 10 Gbit/s Ethernet (TCP, alpha 25 us); within a node 8 ranks on a 200
    Gbit/s, 0.5 us fabric; gamma (the sum) 10 GB/s; DDP buckets of 1 MB then 25 MB;
  * hpcgrad's own cost: +5 us per all-reduce call (benchmarks/comm.py --overhead: 1.9-7.6 us).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import scaling_model as model  # noqa: E402  (benchmarks/, beside this script)

FLOAT = 4
MB = 1 << 20
GRADIENTS = {  # name: (parameters, compute seconds per step on one rank)
    "MLP": (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10, 33.6e-3),
    "CNN": (1 * 8 * 9 + 8 + 8 * 16 * 9 + 16 + 16 * 7 * 7 * 10 + 10, 12.8e-3),
    "ResNet-50": (25_500_000, 100e-3),
    "ResNet-101": (44_500_000, 490e-3),
}
SPLIT = (0.3, 0.6, 0.1)  # forward, backward, optimizer shares of the compute
RANKS = [2 ** k for k in range(3, 13)]  # 8 .. 4096
HPCGRAD_CALL = 5e-6  # seconds hpcgrad adds per all-reduce call


def fabrics(gamma):
    return [model.Fabric.from_bandwidth("IB 100 Gbit/s", 1.5, 100, gamma),
            model.Fabric.from_bandwidth("Ethernet 25 Gbit/s", 5, 25, gamma),
            model.Fabric.from_bandwidth("Ethernet 10 Gbit/s", 25, 10, gamma)]


def algorithms(inter, intra, per_node, overhead):
    """name -> allreduce(nbytes, p) seconds, block placement, ``overhead`` added per call."""
    def split(p):
        return max(1, p // per_node), min(p, per_node)

    def flat(algorithm):
        def run(n, p):
            nodes, r = split(p)
            return model.flat_allreduce(n, nodes, r, intra, inter, algorithm) + overhead
        return run

    def hier(n, p):
        nodes, r = split(p)
        return model.hierarchical_allreduce(n, nodes, r, intra, inter, "rabenseifner") + overhead
    return {"mpich": flat("rabenseifner"), "ring": flat("ring"), "hier": hier}


def predict(params, compute, allreduce, p, overlap=True):
    f, b, o = (share * compute for share in SPLIT)
    sizes = model.buckets(params * FLOAT)
    if overlap:
        return model.ddp_step(sizes, f, b, o, lambda n: allreduce(n, p))
    # no overlap: every bucket's all-reduce after backward (MPI not progressed during it)
    return model.ddp_step([sum(sizes)], f, b, o, lambda n: sum(allreduce(s, p) for s in sizes))


def table(inter, intra, per_node, overhead, ranks, gradients=("MLP", "CNN", "ResNet-50")):
    """Rows of (gradient, ranks, {algorithm: Step}) and the printed lines."""
    algos = algorithms(inter, intra, per_node, overhead)
    rows, lines = [], []
    head = f"{'gradient':>10} {'MB':>7} {'ranks':>6}" + "".join(
        f" {name + ' ms':>10} {name + ' eff':>9}" for name in algos)
    lines += [(f"{inter.name} (alpha {inter.alpha * 1e6:.2f} us, {1 / inter.beta / 1e9:.2f} GB/s), "
               f"in-node {intra.name} (alpha {intra.alpha * 1e6:.2f} us, "
               f"{1 / intra.beta / 1e9:.2f} GB/s), gamma "
               f"{1 / inter.gamma / 1e9 if inter.gamma else float('inf'):.1f} GB/s, "
               f"{per_node} ranks/node, +{overhead * 1e6:.1f} us per all-reduce"), head,
              "-" * len(head)]
    for name in gradients:
        params, compute = GRADIENTS[name]
        for p in ranks:
            steps = {a: predict(params, compute, run, p) for a, run in algos.items()}
            rows.append((name, p, steps))
            lines.append(f"{name:>10} {params * FLOAT / 1e6:7.2f} {p:6d}" + "".join(
                f" {s.step * 1e3:10.2f} {s.efficiency * 100:8.1f}%" for s in steps.values()))
    return rows, lines


def anchors(gamma, per_node_overhead):
    """Lines comparing the model with published scaling figures, with and without hpcgrad's
    own costs (its per-call Python share, and no overlap when nothing progresses MPI)."""
    intra = model.Fabric.from_bandwidth("NVLink-class", 0.5, 200, gamma)
    cases = [  # (who, gradient, ranks, ranks/node, fabric, published)
        ("Horovod (Sergeev & Del Balso 2018)", "ResNet-101", 512, 4,
         model.Fabric.from_bandwidth("RoCE 25 Gbit/s", 5, 25, gamma), "90%"),
        ("PyTorch DDP (Li et al. 2020)", "ResNet-50", 256, 8,
         model.Fabric.from_bandwidth("IB 100 Gbit/s", 1.5, 100, gamma), "near-linear"),
    ]
    lines = [(f"{'published':>36} {'gradient':>10} {'ranks':>6} {'fabric':>16} {'said':>12} "
             f"{'model':>7} {'ring':>7} {'+hpcgrad':>9} {'no overlap':>11}")]
    for who, grad, p, per_node, inter, said in cases:
        params, compute = GRADIENTS[grad]
        algos = algorithms(inter, intra, per_node, 0.0)
        ours = algorithms(inter, intra, per_node, per_node_overhead)
        base = predict(params, compute, algos["mpich"], p).efficiency
        ring = predict(params, compute, algos["ring"], p).efficiency
        plus = predict(params, compute, ours["mpich"], p).efficiency
        serial = predict(params, compute, ours["mpich"], p, overlap=False).efficiency
        lines.append(f"{who:>36} {grad:>10} {p:6d} {inter.name:>16} {said:>12} "
                     f"{base * 100:6.1f}% {ring * 100:6.1f}% {plus * 100:8.1f}% "
                     f"{serial * 100:10.1f}%")
    return lines


# --- validation against the simulated cluster ---------------------------------------------------
def load_runs(paths):
    """{(nodes, ranks per node, placement): {bytes: {impl: seconds}}} from cluster_allreduce.py
    JSON files (the later file wins a layout measured twice)."""
    runs = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for result in data["results"]:
            nodes = result["nodes"]
            key = (nodes, result["ranks"] // nodes, result.get("placement", "block"))
            runs[key] = {row["bytes"]: row["seconds"] for row in result["rows"]}
    return runs


def _fit(rows, impl, lo=MB):
    sizes = sorted(n for n in rows if n >= lo)
    return model.fit_alpha_beta(sizes, [rows[n][impl] for n in sizes], 2)


def fit_cluster(runs, unshaped=None, cores=2):
    """The fits of the module docstring: (intra, stages, inter, tcp cpu beta or None, slice)."""
    one = runs[1, 2, "block"]
    alpha, beta = _fit(one, "flat")
    intra = model.Fabric("shared memory (fit, 1x2 flat)", alpha, beta)
    alpha, beta = _fit(one, "hier")  # reduce + broadcast on 2 ranks: 2 alpha + 2 n beta
    stages = model.Fabric("MPICH Ireduce/Ibcast (fit, 1x2 hier)", alpha, beta / 2)
    alpha, beta = _fit(runs[2, 1, "block"], "flat")
    inter = model.Fabric("shaped link (fit, 2x1 flat)", alpha, beta)
    cpu = _fit(unshaped[2, 1, "block"], "flat")[1] if unshaped else None
    fits = (intra, stages, inter, cpu, 0.0)
    # the time slice: linear in the model, least squares by relative error over 1x4's rows
    rows = runs.get((1, 4, "block"), {})
    t0, t1, got = [], [], []
    for nbytes in (n for n in rows if n >= MB):
        for impl, i in (("flat", 0), ("hier", 1)):
            t0.append(model_cluster(nbytes, 1, 4, "block", fits, cores, 0.0)[i])
            t1.append(model_cluster(nbytes, 1, 4, "block", (*fits[:4], 1.0), cores, 0.0)[i])
            got.append(rows[nbytes][impl])
    if not got:
        return fits
    t0, slope, got = np.array(t0), np.array(t1) - np.array(t0), np.array(got)
    slice_s = float(np.sum(slope / got * (got - t0) / got) / np.sum((slope / got) ** 2))
    return (*fits[:4], max(0.0, slice_s))


def model_cluster(nbytes, nodes, per_node, placement, fits, cores, overhead):
    """(flat, hierarchical) seconds on the simulated cluster: ranks on ``cores`` cores."""
    intra, stages, inter, cpu, slice_s = fits
    p = nodes * per_node
    intra_c = model.contended(intra, p, cores, time_slice=slice_s)
    stages_c = model.contended(stages, p * model.tree_busy(per_node), cores, time_slice=slice_s)
    inter_c = model.contended(inter, p, cores, cpu_beta=cpu or 0.0, time_slice=slice_s)
    flat = model.flat_allreduce(nbytes, nodes, per_node, intra_c, inter_c, placement=placement)
    # in the node, MPICH's Ireduce and Ibcast (their own fit); among leaders, MPICH's all-reduce
    hier = model.hierarchical_allreduce(nbytes, nodes, per_node, stages_c, inter_c, "rabenseifner")
    return flat + overhead, hier + 3 * overhead


def baseline(runs, fitted):
    """The first model's errors on the predicted rows: one alpha and beta per fabric fitted on
    every size (4 KB-64 MB), flat = a ring on the slower fabric, no contention."""
    intra = model.Fabric("intra", *_fit(runs[1, 2, "block"], "flat", lo=0))
    inter = model.Fabric("inter", *_fit(runs[2, 1, "block"], "flat", lo=0))
    errs = []
    for key, rows in runs.items():
        if key in fitted or key[2] != "block":
            continue
        nodes, per_node, _ = key
        for nbytes in (n for n in rows if n >= MB):
            flat = model.ring_allreduce(nbytes, nodes * per_node, inter if nodes > 1 else intra)
            hier = model.hierarchical_allreduce(nbytes, nodes, per_node, intra, inter)
            errs += [abs(flat - rows[nbytes]["flat"]) / rows[nbytes]["flat"],
                     abs(hier - rows[nbytes]["hier"]) / rows[nbytes]["hier"]]
    if not errs:
        return "no rows"
    errs = np.array(errs)
    return (f"median |error| {np.median(errs) * 100:.1f}%, {np.mean(errs <= 0.15) * 100:.0f}% "
            f"within 15%, max {errs.max() * 100:.0f}% (block placement only: it has no other)")


def validate(runs, fits, cores, overhead):
    """Printed lines: the fits, then model vs measured per layout and size, and a summary."""
    intra, stages, inter, cpu, slice_s = fits
    lines = ["fits (sizes >= 1 MB):"]
    for fab in (intra, stages, inter):
        lines.append(f"  {fab.name}: alpha {fab.alpha * 1e6:.1f} us, beta {fab.beta * 1e9:.3f} "
                     f"ns/B ({1 / fab.beta / 1e9:.3f} GB/s)")
    if cpu is not None:
        lines.append(f"  TCP CPU cost (fit, 2x1 unshaped): {cpu * 1e9:.3f} ns/B "
                     f"({1 / cpu / 1e9:.3f} GB/s)")
    lines.append(f"  scheduler time slice (fit, 1x4 flat and hier): {slice_s * 1e3:.2f} ms")
    lines.append(f"  {cores} cores; +{overhead * 1e6:.0f} us per call and per hierarchical stage")
    head = (f"{'layout':>8} {'place':>6} {'ranks':>5} {'size':>6} {'flat ms':>9} {'model':>8} "
            f"{'err':>7} {'hier ms':>9} {'model':>8} {'err':>7}")
    lines += ["", head, "-" * len(head)]
    errors = []
    fitted = {(1, 2, "block"), (2, 1, "block"), (1, 4, "block")}
    for key in sorted(runs, key=lambda k: (k[0] * k[1], k[0], k[2])):
        nodes, per_node, placement = key
        for nbytes in sorted(n for n in runs[key] if n >= MB):
            got = runs[key][nbytes]
            flat, hier = model_cluster(nbytes, nodes, per_node, placement, fits, cores, overhead)
            ef = (flat - got["flat"]) / got["flat"]
            eh = (hier - got["hier"]) / got["hier"]
            tag = " (fit)" if key in fitted else ""
            if not tag:
                errors.append((key, nbytes, ef, eh,
                               (flat < hier) == (got["flat"] < got["hier"])))
            lines.append(f"{nodes:>4}x{per_node:<3} {placement:>6} {nodes * per_node:5d} "
                         f"{nbytes // MB:4d}MB {got['flat'] * 1e3:9.1f} {flat * 1e3:8.1f} "
                         f"{ef * 100:6.1f}% {got['hier'] * 1e3:9.1f} {hier * 1e3:8.1f} "
                         f"{eh * 100:6.1f}%{tag}")
    if errors:
        every = np.abs([e for _, _, ef, eh, _ in errors for e in (ef, eh)])
        lines += ["", (f"predicted rows: {len(errors)} layouts x sizes, {every.size} figures: "
                      f"median |error| {np.median(every) * 100:.1f}%, "
                      f"{np.mean(every <= 0.15) * 100:.0f}% within 15%, max "
                      f"{every.max() * 100:.0f}%")]
        flat_only = np.abs([ef for _, _, ef, _, _ in errors])
        lines.append(f"  flat only: median |error| {np.median(flat_only) * 100:.1f}%, "
                     f"{np.mean(flat_only <= 0.15) * 100:.0f}% within 15%")
        for label, pick in (("4 MB and above", lambda k, n: n >= 4 * MB),
                            ("flat, 4 MB and above", lambda k, n: n >= 4 * MB)):
            both = not label.startswith("flat")
            sub = np.abs([e for k, n, ef, eh, _ in errors if pick(k, n)
                          for e in ((ef, eh) if both else (ef,))])
            if sub.size:
                lines.append(f"  {label}: median |error| {np.median(sub) * 100:.1f}%, "
                             f"{np.mean(sub <= 0.15) * 100:.0f}% within 15% ({sub.size} figures)")
        lines.append(f"  the first model on the same rows: {baseline(runs, fitted)}")
        right = sum(ok for *_, ok in errors)
        lines.append(f"  the faster of flat and hierarchical: model right in {right} of "
                     f"{len(errors)} rows")
    return lines


def load_ddp(paths):
    """benchmarks/cluster_allreduce.py --ddp entries from JSON files."""
    out = []
    for path in paths:
        with open(path) as f:
            out += json.load(f).get("ddp", [])
    return out


def validate_ddp(entries, fits, cores, overhead):
    """Printed lines: benchmarks/ddp.py's MLP step on the simulated cluster against the model
    fed with the measured compute-only step and the modelled flat all-reduce per bucket."""
    head = (f"{'layout':>8} {'compute':>8} {'allreduce':>10} {'model':>7} {'err':>7} "
            f"{'step':>7} {'model':>7} {'err':>7} {'no-overlap model':>17}")
    lines = [("DDP step, MLP 784-1024-1024-10, batch 256 per rank (ms; compute = measured "
             "compute-only step, split 30/60/10)"), head, "-" * len(head)]
    for e in entries:
        nodes, p = e["nodes"], e["ranks"]
        per_node, f = p // nodes, e["ddp"]
        compute = f["compute"][0]

        def allreduce(n, nodes=nodes, per_node=per_node, placement=e["placement"]):
            return model_cluster(n, nodes, per_node, placement, fits, cores, overhead)[0]
        whole = allreduce(f["bytes"])
        sizes = model.buckets(f["bytes"])
        fw, bw, op = (share * compute for share in SPLIT)
        step = model.ddp_step(sizes, fw, bw, op, allreduce).step
        serial_comm = sum(allreduce(b) for b in sizes)
        serial = model.ddp_step([f["bytes"]], fw, bw, op, lambda n, t=serial_comm: t).step
        got_comm, got_step = f["comm"][0], f["step"][0]
        lines.append(f"{nodes:>4}x{per_node:<3} {compute * 1e3:8.1f} {got_comm * 1e3:10.1f} "
                     f"{whole * 1e3:7.1f} {(whole - got_comm) / got_comm * 100:6.1f}% "
                     f"{got_step * 1e3:7.1f} {step * 1e3:7.1f} "
                     f"{(step - got_step) / got_step * 100:6.1f}% {serial * 1e3:17.1f}")
    return lines


def fit_bucket_cost(rows):
    """(alpha, beta) of one bucket's all-reduce, ``alpha + n beta``, from the comm-alone
    medians of benchmarks/ddp_cluster.py rows (each row: its buckets reduced back to back,
    so comm = k alpha + (sum of n) beta); least squares on relative error."""
    design = np.array([[len(r["bucket_bytes"]), sum(r["bucket_bytes"])] for r in rows], float)
    got = np.array([r["comm"] for r in rows])
    w = 1.0 / got
    (alpha, beta), *_ = np.linalg.lstsq(design * w[:, None], got * w, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def predict_ddp_cluster(row, alpha, beta, pause):
    """The model's step for one benchmarks/ddp_cluster.py row from that run's measurements;
    each bucket's all-reduce ``alpha + n beta``, the progress thread as in the row. Three
    models, each adding measured inputs:

      by bytes  forward (+ zero_grad), backward and optimizer: the compute-only median split
                as the medians of its parts; buckets ready at a rate proportional to their
                bytes; without the thread every all-reduce after backward (the first model)
      ready     + the buckets ready as launched in the row's DDP steps (their fraction of
                the step's backward), and without the thread the all-reduces' share that
                went on during ``pause`` seconds without MPI calls (``ahead``: comm - (pause
                quantity - pause)) sent from launch on
      in step   + forward, backward and the tail after the write-back as they ran in the DDP
                steps themselves (with the thread polling a pending all-reduce, compute runs
                slower than alone): what is left to predict is the communication.
    """
    sp, tl = row["split"], row["timeline"]
    parts = (sp["forward"] + sp["zero_grad"], sp["backward"], sp["optimizer"])
    # the parts' medians need not add up to the compute median (a bimodal load): keep their
    # shares, and the compute median
    fw, bw, op = (x / sum(parts) * row["compute"] for x in parts)
    sizes = row["bucket_bytes"]
    step_bw = (tl["finalize"] - tl["forward"]) / 1e3
    launched = [(t - tl["forward"]) / 1e3 for t in tl["launch"]]
    ready = [min(max(t / step_bw, 0.0), 1.0) * bw for t in launched]
    on = row["progress"] == "on"
    ahead = 0.0 if on else max(0.0, row["comm"] - (row["pause"] - pause))

    def cost(n):
        return alpha + n * beta
    in_step = model.ddp_step(sizes, tl["forward"] / 1e3, step_bw,
                             (tl["end"] - tl["written"]) / 1e3, cost,
                             ready=[min(max(t, 0.0), step_bw) for t in launched],
                             progress=on, ahead=ahead)
    return (model.ddp_step(sizes, fw, bw, op, cost, progress=on).step,
            model.ddp_step(sizes, fw, bw, op, cost, ready=ready, progress=on,
                           ahead=ahead).step,
            in_step.step)


def validate_ddp_cluster(paths, markdown=False):
    """Printed lines: model vs measured DDP step for every benchmarks/ddp_cluster.py --json
    result (flat all-reduce rows only), and a summary of the errors; ``markdown``: the rows as
    a Markdown table (docs/scaling.md)."""
    names = ("layout", "rate", "model", "thread", "compute", "comm", "ahead", "step",
             "by bytes", "err", "ready", "err", "in step", "err")
    widths = (6, 8, 9, 6, 8, 6, 5, 6, 8, 6, 6, 6, 7, 6)
    if markdown:
        lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    else:
        head = " ".join(f"{n:>{w}}" for n, w in zip(names, widths))
        lines = [head, "-" * len(head)]
    errors = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for result in run["results"]:
            rows = [r for r in result["rows"] if r["hierarchical"] == "0"]
            # per thread setting: oversubscribed, the thread slows the all-reduce alone 2-3x
            fits = {t: fit_bucket_cost([r for r in rows if r["progress"] == t])
                    for t in {r["progress"] for r in rows}}
            pause = result.get("pause_ms", 40.0) * 1e-3
            layout = f"{result['nodes']}x{result['ranks_per_node']}"
            if not markdown:
                lines.append(f"# {path} ({run['date']}), {layout} at {result['rate']}, load "
                             f"{result['load']:.1f}, medians of {rows[0]['repeats']}; bucket "
                             "all-reduce fitted on the comm-alone medians, " + ", ".join(
                                 f"thread {t}: {a * 1e3:.2f} ms + {b * 1e9:.2f} ns/B"
                                 for t, (a, b) in sorted(fits.items())))
            for r in rows:
                alpha, beta = fits[r["progress"]]
                got = r["step"]
                preds = predict_ddp_cluster(r, alpha, beta, pause)
                errs = [(m - got) / got for m in preds]
                errors.setdefault((layout, r["progress"]), []).append(errs)
                cells = [layout, result["rate"], r["model"], r["progress"]]
                cells += [f"{x * 1e3:.1f}" for x in (r["compute"], r["comm"],
                                                     r["comm"] - r["pause"] + pause, got)]
                for m, e in zip(preds, errs):
                    cells += [f"{m * 1e3:.1f}", f"{e:.1%}"]
                if markdown:
                    lines.append("| " + " | ".join(cells) + " |")
                else:
                    lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append("")
    lines.append("errors (model - measured) / measured, median |error| and max |error| of the "
                 "rows: by bytes; ready (+ ahead); in step")
    for (layout, thread), errs in sorted(errors.items()):
        a = np.abs(np.array(errs))
        lines.append(f"  {layout} thread {thread:3}: " + "; ".join(
            f"{np.median(a[:, k]):.1%}, {a[:, k].max():.1%}" for k in range(3))
            + f" ({len(errs)} rows, {np.mean(a[:, 1] <= 0.15):.0%} of them within 15% "
            "with measured ready times)")
    return lines


# --- fit on this machine (no cluster) -----------------------------------------------------------
def fit_from_json(path):
    """(alpha, beta, ranks) from benchmarks/comm.py --json output (its raw Allreduce column)."""
    with open(path) as f:
        data = json.load(f)
    sizes = [row["bytes"] for row in data["rows"]]
    seconds = [row["seconds"]["raw"] for row in data["rows"]]
    return (*model.fit_alpha_beta(sizes, seconds, data["ranks"]), data["ranks"])


def measure_and_fit(repeats=11):
    """Time comm.Allreduce (mpi4py, in place, float32) at 4 KB..16 MB on every rank of this
    mpiexec job; (alpha, beta, ranks, rows) from the medians of the slowest rank's times."""
    from mpi4py import MPI  # only this mode needs MPI: the predictions run without it
    comm = MPI.COMM_WORLD
    sizes = [4096 * 4 ** k for k in range(7)]
    rows = []
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        k = max(1, min(100, (256 << 10) // nbytes))  # back-to-back calls: a latency is not a tick
        times = []
        for _ in range(repeats + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                comm.Allreduce(MPI.IN_PLACE, buf)
            times.append((time.perf_counter() - t0) / k)
        slowest = comm.allreduce(float(np.median(times[1:])), op=MPI.MAX)
        rows.append((nbytes, slowest))
    p = comm.Get_size()
    alpha, beta = model.fit_alpha_beta([r[0] for r in rows], [r[1] for r in rows], p)
    return alpha, beta, p, rows, comm.Get_rank()


def plot(all_rows, path, per_node):
    """Efficiency vs ranks: one panel per fabric, a line per gradient and algorithm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(all_rows), figsize=(5 * len(all_rows), 4.5), sharey=True)
    colors = dict(zip(GRADIENTS, ("C0", "C1", "C2", "C3")))
    for ax, (fabric, rows) in zip(np.atleast_1d(axes), all_rows):
        names = dict.fromkeys(g for g, _, _ in rows)
        for name in names:
            mine = [(p, steps) for g, p, steps in rows if g == name]
            for algo, style in zip(mine[0][1], ("-", "--", ":")):
                ax.plot([p for p, _ in mine], [s[algo].efficiency * 100 for _, s in mine],
                        style, color=colors[name], marker="o", markersize=3,
                        label=f"{name} {algo}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_title(f"{fabric.name}, {per_node} ranks/node", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, 105)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("parallel efficiency, weak scaling (%)")
    first.legend(fontsize=7, ncol=1)
    fig.suptitle("DDP step efficiency predicted by the alpha-beta model "
                 "(benchmarks/scaling.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--validate", nargs="+", metavar="JSON", help="model vs measurement on "
                   "simulated-cluster runs (benchmarks/cluster_allreduce.py --json)")
    p.add_argument("--ddp", nargs="+", metavar="JSON", help="with --validate: DDP steps "
                   "measured on the cluster (benchmarks/cluster_allreduce.py --ddp --json)")
    p.add_argument("--unshaped", metavar="JSON", help="a 2x1 run on unshaped links: the TCP "
                   "stack's CPU cost per byte")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the "
                   "simulated cluster's ranks share (default: this machine's)")
    p.add_argument("--fit", action="store_true", help="under mpiexec: measure comm.Allreduce "
                   "and fit alpha, beta (printed, and used as the in-node fabric)")
    p.add_argument("--fit-json", metavar="FILE", help="fit alpha, beta from benchmarks/comm.py "
                   "--json FILE instead (used as the in-node fabric)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--gamma-gbs", type=float, default=10.0, help="reduction speed, GB/s "
                   "(0: free)")
    p.add_argument("--overhead-us", type=float, default=HPCGRAD_CALL * 1e6, help="added to "
                   "every all-reduce (hpcgrad's per-call Python cost; default 5)")
    p.add_argument("--plot", metavar="PATH", help="efficiency vs ranks per fabric (PNG)")
    p.add_argument("--ddp-cluster", nargs="+", metavar="JSON", help="model vs measured DDP "
                   "step on benchmarks/ddp_cluster.py --json runs, inputs from the same run")
    p.add_argument("--markdown", action="store_true", help="with --ddp-cluster: the rows as a "
                   "Markdown table")
    args = p.parse_args(argv)
    overhead = args.overhead_us * 1e-6
    if args.ddp_cluster:
        print("\n".join(validate_ddp_cluster(args.ddp_cluster, args.markdown)))
        return
    if args.validate:
        runs = load_runs(args.validate)
        unshaped = load_runs([args.unshaped]) if args.unshaped else None
        fits = fit_cluster(runs, unshaped, args.cores)
        print("\n".join(validate(runs, fits, args.cores, overhead)))
        if args.ddp:
            print()
            print("\n".join(validate_ddp(load_ddp(args.ddp), fits, args.cores, overhead)))
        return
    gamma = 1 / (args.gamma_gbs * 1e9) if args.gamma_gbs > 0 else 0.0
    intra = model.Fabric.from_bandwidth("shared memory", 0.5, 200, gamma)
    if args.fit or args.fit_json:
        if args.fit:
            alpha, beta, nranks, measured, rank = measure_and_fit()
            if rank != 0:
                return
        else:
            alpha, beta, nranks = fit_from_json(args.fit_json)
            measured = None
        print(f"fit over {nranks} ranks: alpha {alpha * 1e6:.2f} us, beta {beta * 1e9:.4f} ns/B "
              f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s, gamma included)")
        if measured:
            fitted = model.Fabric("fit", alpha, beta)
            print(f"{'bytes':>10} {'measured us':>12} {'model us':>10} {'error':>7}")
            for nbytes, t in measured:
                m = model.ring_allreduce(nbytes, nranks, fitted)
                print(f"{nbytes:10d} {t * 1e6:12.1f} {m * 1e6:10.1f} {(m - t) / t * 100:6.1f}%")
        # the fit folds gamma into beta: keep it there, not twice
        intra = model.Fabric("fitted here", alpha, beta, 0.0)
        print()
    all_rows = []
    for fabric in fabrics(gamma):
        rows, lines = table(fabric, intra, args.ranks_per_node, overhead, RANKS)
        all_rows.append((fabric, rows))
        print("\n".join(lines))
        print()
    print("published anchors (model: MPICH's algorithm, no hpcgrad cost; ring: a flat ring "
          f"instead; +hpcgrad: +{args.overhead_us:.0f} us per call; no overlap: and every "
          "all-reduce after backward, as when nothing progresses MPI during it)")
    print("\n".join(anchors(gamma, overhead)))
    if args.plot:
        plot(all_rows, args.plot, args.ranks_per_node)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
