"""The scaling model (benchmarks/scaling_model.py, beside the benchmark that uses it) against
hand-computed costs, limits and fits."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scaling_model as model  # noqa: E402

A, B, G = 2e-6, 1e-9, 0.25e-9  # alpha, beta, gamma: round numbers to compute by hand
FAB = model.Fabric("test", A, B, G)
N = 1_000_000


@pytest.mark.parametrize("p, want", [
    (2, 2 * A + 2 * 0.5 * N * B + 0.5 * N * G),          # 2 alpha + n beta + n/2 gamma
    (4, 6 * A + 2 * 0.75 * N * B + 0.75 * N * G),
    (8, 14 * A + 2 * 0.875 * N * B + 0.875 * N * G),
])
def test_ring_hand_computed(p, want):
    assert model.ring_allreduce(N, p, FAB) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("p, steps", [(2, 1), (4, 2), (8, 3), (5, 3)])
def test_tree_hand_computed(p, steps):
    want = steps * (A + N * B + N * G)
    assert model.tree_allreduce(N, p, FAB) == pytest.approx(want, rel=1e-12)


def test_one_rank_costs_nothing():
    assert model.ring_allreduce(N, 1, FAB) == 0
    assert model.tree_allreduce(N, 1, FAB) == 0
    assert model.hierarchical_allreduce(N, 1, 1, FAB, FAB) == 0


def test_ring_bandwidth_term_tends_to_2_n_beta():
    no_latency = model.Fabric("bw", 0.0, B)
    assert model.ring_allreduce(N, 10**6, no_latency) == pytest.approx(2 * N * B, rel=1e-5)
    # and the latency term grows linearly: 2 (p-1) alpha
    latency_only = model.Fabric("lat", A, 0.0)
    assert model.ring_allreduce(N, 4096, latency_only) == pytest.approx(2 * 4095 * A)


def test_hierarchical_hand_computed():
    intra = model.Fabric("intra", 1e-6, 0.1e-9)
    inter = model.Fabric("inter", 5e-6, 1e-9)
    n = 8  # tiny message: binomial tree in the node, log2(4) = 2 steps each way
    reduce = 2 * (1e-6 + n * 0.1e-9)
    bcast = 2 * (1e-6 + n * 0.1e-9)
    ring = 2 * 3 * 5e-6 + 2 * 0.75 * n * 1e-9  # 4 leaders
    assert model.hierarchical_allreduce(n, 4, 4, intra, inter) == pytest.approx(
        reduce + ring + bcast, rel=1e-12)
    # large message: reduce-scatter + gather and scatter + all-gather win over the tree
    n = 64 * model.MB
    reduce = (3 + 2) * 1e-6 + 2 * 0.75 * n * 0.1e-9
    bcast = (2 + 3) * 1e-6 + 2 * 0.75 * n * 0.1e-9
    ring = 2 * 3 * 5e-6 + 2 * 0.75 * n * 1e-9
    assert model.hierarchical_allreduce(n, 4, 4, intra, inter) == pytest.approx(
        reduce + ring + bcast, rel=1e-12)
    # one rank per node is the flat ring among nodes
    assert model.hierarchical_allreduce(n, 4, 1, intra, inter) == model.ring_allreduce(n, 4, inter)


def test_fabric_from_bandwidth():
    ib = model.Fabric.from_bandwidth("ib", 1.5, 100)
    assert ib.alpha == pytest.approx(1.5e-6)
    assert ib.beta == pytest.approx(1 / 12.5e9)  # 100 Gbit/s = 12.5 GB/s
    with pytest.raises(ValueError, match="bandwidth > 0"):
        model.Fabric.from_bandwidth("bad", 1, 0)


def test_bad_rank_count_is_refused():
    with pytest.raises(ValueError, match="positive integer, got 0"):
        model.ring_allreduce(N, 0, FAB)


def test_buckets_first_small_then_cap():
    mb = model.MB
    assert model.buckets(60 * mb) == [mb, 25 * mb, 25 * mb, 9 * mb]
    assert model.buckets(mb // 2) == [mb // 2]
    assert model.buckets(0) == []


def test_fit_recovers_alpha_beta_from_synthetic_data():
    sizes = 4096 * 4.0 ** np.arange(8)  # 4 KB .. 64 MB, as benchmarks/comm.py sweeps
    for p in (2, 3, 8):
        exact = model.ring_allreduce
        times = np.array([exact(n, p, model.Fabric("x", 3e-6, 2e-10)) for n in sizes])
        alpha, beta = model.fit_alpha_beta(sizes, times, p)
        assert alpha == pytest.approx(3e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)
        noisy = times * np.random.default_rng(p).uniform(0.97, 1.03, times.size)
        alpha, beta = model.fit_alpha_beta(sizes, noisy, p)
        assert alpha == pytest.approx(3e-6, rel=0.1) and beta == pytest.approx(2e-10, rel=0.1)


def test_fit_refuses_one_rank_and_too_few_points():
    with pytest.raises(ValueError, match=">= 2 ranks"):
        model.fit_alpha_beta([1, 2], [1e-6, 2e-6], 1)
    with pytest.raises(ValueError, match=">= 2 \\(size, time\\) pairs"):
        model.fit_alpha_beta([1], [1e-6], 2)


def test_overlap_fully_hidden():
    # two equal buckets, each all-reduce 1 s, backward 10 s: ready at 5 and 10, done at 6 and 11
    step = model.ddp_step([100, 100], 2.0, 10.0, 0.5, lambda n: 1.0)
    assert step.comm_end == pytest.approx(11.0)
    assert step.step == pytest.approx(2.0 + 11.0 + 0.5)
    assert step.exposed == pytest.approx(1.0)  # only the last bucket's all-reduce shows
    # ten buckets ready at 1, 2, .., 10 s, each reduced in 0.5 s before the next is ready:
    # all is hidden but the last bucket's own all-reduce
    step = model.ddp_step([100] * 10, 2.0, 10.0, 0.5, lambda n: 0.5)
    assert step.comm_end == pytest.approx(10.5) and step.exposed == pytest.approx(0.5)
    assert step.communication == pytest.approx(5.0)
    step = model.ddp_step([100, 100], 2.0, 10.0, 0.5, lambda n: 0.0)
    assert step.step == step.compute and step.efficiency == 1.0


def test_overlap_communication_bound():
    # all-reduce 4 s per bucket, backward 2 s: buckets queue; step ends with the last one
    step = model.ddp_step([1, 1, 1], 1.0, 3.0, 0.0, lambda n: 4.0)
    # ready at 1, 2, 3; run 1-5, 5-9, 9-13
    assert step.comm_end == pytest.approx(13.0)
    assert step.step == pytest.approx(14.0)
    assert step.communication == pytest.approx(12.0)
    assert step.efficiency == pytest.approx(4.0 / 14.0)


def test_single_bucket_is_no_overlap():
    step = model.ddp_step([50], 1.0, 2.0, 0.25, lambda n: 3.0)
    assert step.step == pytest.approx(1.0 + 2.0 + 3.0 + 0.25)


# --- Rabenseifner, flat all-reduce over shared node links, contention ------------------------
INTRA = model.Fabric("intra", 1e-6, 0.1e-9, 0.05e-9)
INTER = model.Fabric("inter", 10e-6, 1e-9, 0.05e-9)


def test_rabenseifner_hand_computed():
    # p = 4: 2 log2 4 alpha + 2 (3/4) n beta + (3/4) n gamma
    want = 4 * A + 1.5 * N * B + 0.75 * N * G
    assert model.rabenseifner_allreduce(N, 4, FAB) == pytest.approx(want, rel=1e-12)
    # p = 3: rank 0 folds into rank 1 (whole buffer there and back), then p = 2
    want = 2 * A + N * B + 0.5 * N * G + 2 * (A + N * B) + N * G
    assert model.rabenseifner_allreduce(N, 3, FAB) == pytest.approx(want, rel=1e-12)
    assert model.rabenseifner_allreduce(N, 1, FAB) == 0


def test_flat_on_one_fabric_is_the_textbook_cost():
    for p in (2, 4, 8, 6):
        assert model.flat_allreduce(N, 1, p, FAB, INTER) == pytest.approx(
            model.rabenseifner_allreduce(N, p, FAB), rel=1e-12)
        assert model.flat_allreduce(N, p, 1, INTRA, FAB) == pytest.approx(
            model.rabenseifner_allreduce(N, p, FAB), rel=1e-12)
    assert model.flat_allreduce(N, 1, 8, FAB, INTER, "ring") == pytest.approx(
        model.ring_allreduce(N, 8, FAB), rel=1e-12)
    assert model.flat_allreduce(N, 1, 8, FAB, INTER, "tree") == pytest.approx(
        model.tree_allreduce(N, 8, FAB), rel=1e-12)


def test_flat_two_nodes_of_two_block_and_cyclic_by_hand():
    ai, bi, gi = INTRA.alpha, INTRA.beta, INTRA.gamma
    ae, be, ge = INTER.alpha, INTER.beta, INTER.gamma
    # block (nodes 0 0 1 1): distance 1 in the node with n/2, distance 2 across with n/4,
    # both ranks of a node sending theirs through its link; all-gather mirrors it (no sum)
    step_in, step_out = ai + N / 2 * bi, ae + 2 * (N / 4) * be
    want = (step_in + N / 2 * gi) + (step_out + N / 4 * ge) + step_out + step_in
    assert model.flat_allreduce(N, 2, 2, INTRA, INTER) == pytest.approx(want, rel=1e-12)
    # cyclic (nodes 0 1 0 1): the n/2 steps cross, the n/4 ones stay in the node
    step_out, step_in = ae + 2 * (N / 2) * be, ai + N / 4 * bi
    want = (step_out + N / 2 * ge) + (step_in + N / 4 * gi) + step_in + step_out
    assert model.flat_allreduce(N, 2, 2, INTRA, INTER, placement="cyclic") == pytest.approx(
        want, rel=1e-12)
    # ring, block: one rank per node receives from the other node each step
    want = 2 * 3 * (ae + N / 4 * be) + 3 * N / 4 * ge
    assert model.flat_allreduce(N, 2, 2, INTRA, INTER, "ring") == pytest.approx(want, rel=1e-12)
    # recursive doubling, block: whole buffer in the node, then both ranks' across
    want = ai + N * (bi + gi) + ae + 2 * N * be + N * ge
    assert model.flat_allreduce(N, 2, 2, INTRA, INTER, "tree") == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (4, 2), (2, 8), (8, 4)])
def test_block_crosses_the_network_as_much_as_the_hierarchical_leaders_cyclic_r_times(
        nodes, per_node):
    """Note [When hierarchical all-reduce pays]: with free in-node steps and no latency, flat
    Rabenseifner with block placement puts 2 (N-1)/N n bytes on each node link (as the
    leaders' all-reduce does); with cyclic placement r times that."""
    free = model.Fabric("free", 0.0, 0.0)
    wire = model.Fabric("wire", 0.0, 1e-9)
    leaders = 2 * (nodes - 1) / nodes * N * 1e-9
    assert model.flat_allreduce(N, nodes, per_node, free, wire) == pytest.approx(leaders)
    assert model.hierarchical_allreduce(N, nodes, per_node, free, wire, "rabenseifner") == \
        pytest.approx(leaders)
    assert model.flat_allreduce(N, nodes, per_node, free, wire, placement="cyclic") == \
        pytest.approx(per_node * leaders)


def test_flat_refuses_unknown_algorithm_and_placement():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        model.flat_allreduce(N, 2, 2, INTRA, INTER, "butterfly")
    with pytest.raises(ValueError, match="placement must be one of"):
        model.flat_allreduce(N, 2, 2, INTRA, INTER, placement="random")
    with pytest.raises(ValueError, match="leaders must be"):
        model.hierarchical_allreduce(N, 2, 2, INTRA, INTER, leaders="tree")


def test_cpu_beta_overlaps_the_wire():
    # the slower of the wire (load m beta) and the CPU (m cpu_beta) sets a crossing step
    slow_cpu = model.Fabric("link", 0.0, 1e-9, 0.0, cpu_beta=3e-9)
    free = model.Fabric("free", 0.0, 0.0)
    # 2 nodes x 1 rank: two steps of n/2, load 1: wire n/2 * 1e-9, CPU n/2 * 3e-9 each
    assert model.flat_allreduce(N, 2, 1, free, slow_cpu) == pytest.approx(2 * N / 2 * 3e-9)
    fast_cpu = model.Fabric("link", 0.0, 1e-9, 0.0, cpu_beta=0.5e-9)
    assert model.flat_allreduce(N, 2, 1, free, fast_cpu) == pytest.approx(2 * N / 2 * 1e-9)


def test_contended_hand_computed():
    fab = model.Fabric("x", 2e-6, 1e-9, 0.5e-9)
    assert model.contended(fab, 2, 2) == fab  # a core per rank: nothing changes
    shm = model.contended(fab, 8, 2, time_slice=1e-3)  # f = 4
    assert (shm.alpha, shm.beta, shm.gamma) == pytest.approx((4 * 2e-6 + 0.75e-3, 4e-9, 2e-9))
    link = model.contended(fab, 4, 2, cpu_beta=0.2e-9)  # f = 2: only the CPU share stretches
    assert (link.alpha, link.beta, link.gamma, link.cpu_beta) == pytest.approx(
        (4e-6, 1e-9, 1e-9, 0.4e-9))


@pytest.mark.parametrize("per_node, want", [(1, 1.0), (2, 1.0), (4, (1 + 0.5) / 2),
                                            (8, (1 + 0.5 + 0.25) / 3), (3, (1 + 0.5) / 2)])
def test_tree_busy_hand_computed(per_node, want):
    assert model.tree_busy(per_node) == pytest.approx(want)


def test_measured_ready_times():
    # buckets of 3 and 1 bytes: by bytes ready at 7.5 and 10 s of a 10 s backward; measured at
    # 8 and 10 s instead; each all-reduce 3 s: 8-11, 11-14
    step = model.ddp_step([3, 1], 1.0, 10.0, 0.5, lambda n: 3.0, ready=[8.0, 10.0])
    assert step.comm_end == pytest.approx(14.0) and step.step == pytest.approx(15.5)
    by_bytes = model.ddp_step([3, 1], 1.0, 10.0, 0.5, lambda n: 3.0)  # 7.5-10.5, 10.5-13.5
    assert by_bytes.comm_end == pytest.approx(13.5)
    # a bucket ready before the previous all-reduce ends waits for it
    step = model.ddp_step([1, 1], 0.0, 4.0, 0.0, lambda n: 2.0, ready=[1.0, 2.0])  # 1-3, 3-5
    assert step.comm_end == pytest.approx(5.0) and step.exposed == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one time >= 0 s per bucket \\(2\\)"):
        model.ddp_step([1, 1], 0.0, 4.0, 0.0, lambda n: 2.0, ready=[1.0])


def test_no_progress_runs_every_all_reduce_after_backward():
    # without a progress thread the all-reduces (2 + 1 s) start at backward's end (10 s),
    # whenever their buckets were ready: step = 1 + 10 + 3 + 0.5
    for ready in (None, [2.0, 5.0]):
        step = model.ddp_step([2, 1], 1.0, 10.0, 0.5, lambda n: float(n), ready=ready,
                              progress=False)
        assert step.comm_end == pytest.approx(13.0) and step.step == pytest.approx(14.5)
        assert step.exposed == pytest.approx(3.0)


def test_no_progress_but_what_goes_ahead():
    # ahead 1.5 s: bucket 0 (2 s, ready at 2) sends 1.5 s of its all-reduce from 2 to 3.5,
    # the rest (0.5 s) after backward (10-10.5); bucket 1 (1 s) then 10.5-11.5
    step = model.ddp_step([2, 1], 1.0, 10.0, 0.5, lambda n: float(n), ready=[2.0, 5.0],
                          progress=False, ahead=1.5)
    assert step.comm_end == pytest.approx(11.5) and step.step == pytest.approx(13.0)
    # ahead 2.5 s: bucket 0 whole (2-4), bucket 1 0.5 s of it (5-5.5), its rest 10-10.5
    step = model.ddp_step([2, 1], 1.0, 10.0, 0.5, lambda n: float(n), ready=[2.0, 5.0],
                          progress=False, ahead=2.5)
    assert step.comm_end == pytest.approx(10.5)
    # a bucket ready 0.5 s before backward's end sends only that much ahead
    step = model.ddp_step([2], 0.0, 10.0, 0.0, lambda n: float(n), ready=[9.5],
                          progress=False, ahead=5.0)
    assert step.comm_end == pytest.approx(11.5)
    # ahead as long as all communication, buckets ready early: nothing is exposed
    step = model.ddp_step([2, 1], 0.0, 10.0, 0.0, lambda n: float(n), ready=[2.0, 5.0],
                          progress=False, ahead=3.0)
    assert step.comm_end == pytest.approx(6.0) and step.step == pytest.approx(10.0)


# --- benchmarks/scaling.py --ddp-cluster: the model fed with a benchmarks/ddp_cluster.py row --
def _scaling():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scaling.py"
    spec = importlib.util.spec_from_file_location("scaling_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ddp_cluster_fit_and_prediction_by_hand():
    scaling = _scaling()
    # each bucket alpha + n beta = 1 ms + n 10 us: two 1000-byte buckets 22 ms, one of 4000 41 ms
    rows = [{"bucket_bytes": [1000, 1000], "comm": 0.022}, {"bucket_bytes": [4000], "comm": 0.041}]
    alpha, beta = scaling.fit_bucket_cost(rows)
    assert (alpha, beta) == pytest.approx((1e-3, 1e-5))
    # compute-only parts' medians add up to 40 ms, the compute median is 80: scaled 2x to
    # forward 20 (with zero_grad), backward 40, optimizer 20 ms; each bucket 11 ms. In the
    # DDP steps (ms): backward 10-30, buckets launched at 15 and 25 (1/4 and 3/4 of it), the
    # write-back done at 50, the step over at 55.
    row = {"split": {"forward": 0.009, "zero_grad": 0.001, "backward": 0.020,
                     "optimizer": 0.010},
           "compute": 0.080, "bucket_bytes": [1000, 1000], "comm": 0.030, "pause": 0.050,
           "timeline": {"forward": 10.0, "finalize": 30.0, "launch": [15.0, 25.0],
                        "written": 50.0, "end": 55.0}, "progress": "on"}
    # by bytes: ready at 20, 40: 20-31, 40-51 -> 20 + 51 + 20; ready (1/4, 3/4 of 40 ms):
    # 10-21, 30-41 -> 20 + 41 + 20; in step (backward 20, ready 5, 15, tail 5): 5-16, 16-27
    # -> 10 + 27 + 5
    got = scaling.predict_ddp_cluster(row, 1e-3, 1e-5, pause=0.040)
    assert got == pytest.approx((0.091, 0.081, 0.042))
    # thread off: ahead = comm - (pause - 40 ms) = 20 ms. By bytes: all after backward,
    # 20 + 40 + 22 + 20. Ready: bucket 0 wholly ahead (10-21), bucket 1 the 9 ms left (30-39),
    # its last 2 ms after backward (40-42). In step: bucket 0 5-16, bucket 1 4 ms (16-20, when
    # backward ends), its 7 ms left 20-27.
    row["progress"] = "off"
    got = scaling.predict_ddp_cluster(row, 1e-3, 1e-5, pause=0.040)
    assert got == pytest.approx((0.102, 0.082, 0.042))
