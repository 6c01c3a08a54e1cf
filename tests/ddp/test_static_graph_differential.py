"""Differential test of DDP's static_graph fast path (issue 25): static_graph=True against
static_graph=False and against one process training on the concatenated batch.

Random small programs, each several SGD steps with batch sizes that change per step and per rank:
MLPs of random depth, widths and activations; optionally a square layer applied twice in one
forward (a shared parameter), a layer no rank uses and one only rank 0 uses (the plain DDP
finds them with find_unused_parameters=True; static_graph records them in its first iteration);
one bucket, or a bucket per parameter or two. Every model starts from the same values. After each
step the parameters of all three runs must agree (float64; they differ only in the order of
summation). Each rank's loss is the sum of its squared errors times world size / total rows, so
DDP's average over ranks is the mean over the concatenated batch, which the reference minimises.
"""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import nn
from hpcgrad.ddp import buckets
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

PROGRAMS, STEPS, LR = 12, 4, 0.05
TOL = 1e-11
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def make_spec(seed):
    rng = np.random.default_rng([77, seed])
    depth = int(rng.integers(1, 4))
    return {
        "in": int(rng.integers(2, 5)),
        "widths": [int(w) for w in rng.integers(2, 6, depth)],
        "acts": [str(a) for a in rng.choice(sorted(ACTIVATIONS), depth)],
        "out": int(rng.integers(1, 4)),
        "shared": bool(rng.integers(2)),    # the last hidden layer's square twin, used twice
        "unused": bool(rng.integers(2)),    # a layer nobody uses
        "rank0_only": bool(rng.integers(2)),  # a head only rank 0 adds to its output
        "small_buckets": bool(rng.integers(2)),
    }


class RandomNet(nn.Module):
    def __init__(self, spec):
        super().__init__()
        dims = [spec["in"]] + spec["widths"]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.acts = [ACTIVATIONS[name]() for name in spec["acts"]]
        hidden = dims[-1]
        self.twin = nn.Linear(hidden, hidden) if spec["shared"] else None
        self.head = nn.Linear(hidden, spec["out"])
        self.dead = nn.Linear(hidden, spec["out"]) if spec["unused"] else None
        self.extra = nn.Linear(hidden, spec["out"]) if spec["rank0_only"] else None

    def forward(self, x, rank):
        h = x
        for layer, act in zip(self.layers, self.acts):
            h = act(layer(h))
        if self.twin is not None:
            h = self.twin(self.twin(h).tanh()).tanh()  # one parameter, two uses
        y = self.head(h)
        if self.extra is not None and rank == 0:
            y = y + self.extra(h)
        return y


def batch_sizes(seed, size):
    """Rows per rank per step: 1 to 5, changing from step to step."""
    return np.random.default_rng([78, seed, size]).integers(1, 6, (STEPS, size))


def step_data(seed, step, total, spec):
    rng = np.random.default_rng([79, seed, step])
    return rng.standard_normal((total, spec["in"])), rng.standard_normal((total, spec["out"]))


def model_for(spec):
    hg.manual_seed(5)
    return RandomNet(spec).double()


def sgd(model):
    for p in model.parameters():
        if p.grad is not None:
            p.array -= LR * p.grad.array
        p.grad = None


def run_program(seed, group, monkeypatch):
    rank, size = group.rank(), group.size()
    spec = make_spec(seed)
    options = {}
    if spec["small_buckets"]:
        monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 64)
        options["bucket_cap_mb"] = 128 / 2 ** 20
    static_model, dynamic_model, ref = model_for(spec), model_for(spec), model_for(spec)
    static = DDP(static_model, process_group=group, static_graph=True, **options)
    dynamic = DDP(dynamic_model, process_group=group, find_unused_parameters=True, **options)
    sizes = batch_sizes(seed, size)
    for step in range(STEPS):
        counts = sizes[step]
        total = int(counts.sum())
        x, y = step_data(seed, step, total, spec)
        start = int(counts[:rank].sum())
        mine = slice(start, start + int(counts[rank]))
        for ddp in (static, dynamic):
            out = ddp(hg.tensor(x[mine]), rank)
            (((out - hg.tensor(y[mine])) ** 2).sum() * (size / total)).backward()
        # The reference: rank r's rows through rank r's forward (rank 0 adds extra).
        loss = 0.0
        for r in range(size):
            rows = slice(int(counts[:r].sum()), int(counts[:r + 1].sum()))
            loss = loss + ((ref(hg.tensor(x[rows]), r) - hg.tensor(y[rows])) ** 2).sum()
        (loss * (1 / total)).backward()
        for name, p in ref.named_parameters():
            for what, model in (("static_graph=True", static_model),
                                ("static_graph=False", dynamic_model)):
                got = dict(model.named_parameters())[name].grad
                if p.grad is None:  # used by no rank: DDP leaves .grad None too
                    assert got is None, f"program {seed} {spec}: {what} {name} got a gradient"
                    continue
                np.testing.assert_allclose(got.array, p.grad.array, rtol=TOL, atol=TOL,
                                           err_msg=f"program {seed} {spec}: {what} {name}.grad "
                                                   f"at step {step}")
        for model in (static_model, dynamic_model, ref):
            sgd(model)
        want = dict(ref.named_parameters())
        for model in (static_model, dynamic_model):
            for name, p in model.named_parameters():
                np.testing.assert_allclose(p.array, want[name].array, rtol=TOL, atol=TOL,
                                           err_msg=f"program {seed} {spec}: {name} after "
                                                   f"step {step}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_static_graph_matches_dynamic_and_full_batch(group, monkeypatch, seed):
    run_program(seed, group, monkeypatch)
