"""``python -m hpcgrad.plot RUN_DIR``: loss, accuracy and throughput curves of a run, as a PNG.

Reads RUN_DIR/metrics.jsonl (Note [Metrics file] in hpcgrad/training/metrics.py) and writes
RUN_DIR/metrics.png (or ``--out``) with matplotlib, which comes with the ``plot`` extra
(``pip install -e ".[plot]"``).
"""

import argparse
import os
import sys

from hpcgrad.training.metrics import read_metrics

# (panel title, y label, [(metric, kind, label)])
_PANELS = [
    ("Loss", "loss", [("loss", "step", "train (step)"), ("loss", "epoch", "train (epoch)"),
                      ("test_loss", "epoch", "test")]),
    ("Accuracy", "accuracy", [("accuracy", "epoch", "train"), ("test_accuracy", "epoch", "test")]),
    ("Throughput", "samples/s (all ranks)", [("samples_per_s", "epoch", "per epoch"),
                                             ("samples_per_s", "step", "per step")]),
]


def _series(records, metric, kind):
    points = [(r["step"], r[metric]) for r in records
              if r["kind"] == kind and r.get(metric) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(run_dir, out=None, size=(12.0, 3.6), dpi=100):
    """Draw the run's curves; returns the PNG's path. Panels with no data say so."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on a cluster node
        from matplotlib import pyplot
    except ImportError:
        raise ImportError("hpcgrad.plot needs matplotlib: pip install -e \".[plot]\"") from None
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no metric lines yet: let the job run "
                         "until its first step or epoch is logged")
    out = out or os.path.join(run_dir, "metrics.png")
    figure, axes = pyplot.subplots(1, len(_PANELS), figsize=size, dpi=dpi)
    for ax, (title, ylabel, series) in zip(axes, _PANELS):
        drawn = False
        for metric, kind, label in series:
            x, y = _series(records, metric, kind)
            if x:
                style = "-" if kind == "step" else "o-"
                ax.plot(x, y, style, label=label, alpha=0.5 if kind == "step" else 1.0)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if drawn:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    figure.suptitle(os.path.basename(os.path.abspath(run_dir)))
    figure.tight_layout()
    figure.savefig(out)
    pyplot.close(figure)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hpcgrad.plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run's directory (a job's --checkpoint-dir)")
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as error:
        print(f"hpcgrad.plot: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
