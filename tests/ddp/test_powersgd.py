"""PowerSGD comm hook against a hand-written numpy step, plain DDP, and PyTorch's own hook.

Multi-rank tests run at whatever size mpiexec gives (1, 2, 3). Every rank builds all ranks'
gradients from seeds, so the reference (P = sum_r M_r Q, orthogonalize by numpy's QR,
Q = sum_r M_r^T P / N, M ~ P Q^T) is computed locally from the same numbers. Gram-Schmidt and
QR may differ in the signs of P's and Q's columns; P Q^T does not.
"""

import gc

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.ddp import buckets
from hpcgrad.distributed import comm_hooks
from hpcgrad.distributed.grad_bucket import GradBucket
from hpcgrad.distributed.powersgd_hook import (
    PowerSGDState,
    _orthogonalize,
    _should_compress,
    batched_powerSGD_hook,
    powerSGD_hook,
)
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

mpi = pytest.mark.mpi(min_size=1)
TOL = 1e-10  # float64 throughout; only summation order differs from the reference

# (12, 10) and the conv-like (6, 2, 3, 3) -> 6 x 18 compress at ranks 1 and 2; (4,), (2, 3) do not.
SHAPES = [(12, 10), (4,), (6, 2, 3, 3), (2, 3)]


# --- helpers ---------------------------------------------------------------------------------
def make_bucket(arrays, index=0, is_last=True):
    """A GradBucket over one flat float64 buffer holding ``arrays`` (as DDP's reducer builds)."""
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    views, at = [], 0
    for a in arrays:
        views.append(flat[at:at + np.size(a)].reshape(np.shape(a)))
        at += np.size(a)
    return GradBucket(index, flat, [None] * len(arrays), views, is_last)


def unflatten(flat, shapes):
    out, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(flat[at:at + n].reshape(shape))
        at += n
    return out


def rank_grads(rank, step, shapes=SHAPES):
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.standard_normal(s) for s in shapes]


def orthonormal(matrix):
    return np.linalg.qr(matrix)[0]


def compressed(shape, rank, min_rate=2):
    n = shape[0]
    m = int(np.prod(shape)) // n
    r = min(n, m, rank)
    return (n + m) * r * min_rate < n * m, (n, m, r)


def reference_step(inputs, qs, rank):
    """One PowerSGD step on every rank's ``inputs`` (lists of arrays): the averaged result and
    the new Q per compressed tensor (``qs``: the Q each starts from, in order)."""
    size = len(inputs)
    result, new_qs, k = [], [], 0
    for i, shape in enumerate(SHAPES):
        worth, (n, m, _) = compressed(shape, rank)
        if not worth:
            result.append(sum(x[i] for x in inputs) / size)
            continue
        q = orthonormal(qs[k])
        ms = [x[i].reshape(n, m) for x in inputs]
        p = orthonormal(sum(mr @ q for mr in ms))
        q = sum(mr.T @ p for mr in ms) / size
        result.append((p @ q.T).reshape(shape))
        new_qs.append(q)
        k += 1
    return result, new_qs


def initial_qs(rank, seed=7):
    """Starting Qs for the compressed tensors of SHAPES (the same on every rank)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((dims[1], dims[2]))
            for worth, dims in (compressed(s, rank) for s in SHAPES) if worth]


def inject(state, qs, index=0):
    """Warm-start memory as if an earlier step had left ``qs`` (PyTorch's flat layout)."""
    dims = [d for w, d in (compressed(s, state.matrix_approximation_rank) for s in SHAPES) if w]
    state.p_memory_dict[index] = np.zeros(sum(n * r for n, _, r in dims))
    state.q_memory_dict[index] = np.concatenate([q.ravel() for q in qs])


def run_hook(hook, state, arrays, index=0, is_last=True):
    bucket = make_bucket(arrays, index, is_last)
    out = hook(state, bucket).wait()
    return unflatten(np.array(out.array), [np.shape(a) for a in arrays])


def assert_close(got, want, tol=TOL):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# --- one step and several, against the numpy reference ------------------------------------------
@mpi
@pytest.mark.parametrize("rank", [1, 2])
def test_steps_match_numpy_reference_with_error_feedback_and_warm_start(group, rank):
    size, me = group.size(), group.rank()
    state = PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    for step in range(2):  # vanilla: the plain average
        grads = [rank_grads(r, step) for r in range(size)]
        got = run_hook(powerSGD_hook, state, grads[me])
        assert_close(got, [sum(g[i] for g in grads) / size for i in range(len(SHAPES))])
    assert state.iter == 2 and not state.error_dict
    qs = initial_qs(rank)
    inject(state, qs)
    errors = [[np.zeros(s) for s in SHAPES] for _ in range(size)]
    for step in range(2, 6):
        grads = [rank_grads(r, step) for r in range(size)]
        inputs = [[g + e for g, e in zip(grads[r], errors[r])] for r in range(size)]
        want, qs = reference_step(inputs, qs, rank)
        got = run_hook(powerSGD_hook, state, grads[me])
        assert_close(got, want)
        errors = [[x - w for x, w in zip(inputs[r], want)] for r in range(size)]
        assert_close(unflatten(state.error_dict[0], SHAPES), errors[me])
    assert state.iter == 6


@mpi
def test_fresh_q_is_drawn_from_the_shared_seed(group):
    """Without warm-start memory Q comes from ``random_seed``: a seed per bucket and step drawn
    from RandomState(random_seed), the standard-normal Qs drawn in turn from it; all ranks
    agree (P = sum_r M_r Q projects the sum only with one Q)."""
    size, me = group.size(), group.rank()
    state = PowerSGDState(group, 1, start_powerSGD_iter=2, warm_start=False, random_seed=3)
    state.iter = 2
    seeds = np.random.RandomState(3)
    for step in range(2):
        draws = np.random.RandomState(seeds.randint(1_000_000_000))
        qs = [draws.standard_normal((d[1], d[2]))
              for w, d in (compressed(s, 1) for s in SHAPES) if w]
        grads = [rank_grads(r, 9 + step) for r in range(size)]
        want, _ = reference_step(grads, qs, 1)
        got = run_hook(powerSGD_hook, state, grads[me])
        assert_close(got, want)
        state.error_dict.clear()  # each step from the gradient alone
    assert not state.p_memory_dict and not state.q_memory_dict  # warm_start=False keeps none


@mpi
@pytest.mark.parametrize("rank", [1, 2])
def test_low_rank_gradient_is_exact(group, rank):
    """Every rank's M_r = A B_r^T (rank r, one column space): one step gives the mean exactly,
    and nothing is left for error feedback: each rank's error M_r - mean is its own gradient's
    distance from the mean (PyTorch's too), and they sum to zero."""
    size, me = group.size(), group.rank()
    rng = np.random.default_rng(5)
    a = rng.standard_normal((12, rank))
    grads = [[a @ np.random.default_rng(r).standard_normal((10, rank)).T] for r in range(size)]
    state = PowerSGDState(group, rank, start_powerSGD_iter=2)
    state.iter = 2
    got = run_hook(powerSGD_hook, state, grads[me])
    assert_close(got, [sum(g[0] for g in grads) / size])
    error = np.array(state.error_dict[0])
    assert_close([error], [(grads[me][0] - sum(g[0] for g in grads) / size).ravel()])
    dist.all_reduce(error, group=group)
    np.testing.assert_allclose(error, 0, atol=1e-10)


@mpi
def test_error_feedback_makes_applied_updates_track_true_gradients(group):
    """Applied updates out_k and errors e_r,k satisfy, exactly, sum_k out_k = sum_k mean_r g_r,k
    - mean_r e_r,K; with a fixed full-rank gradient the error stays bounded, so the sum of
    updates approaches the sum of gradients. Without error feedback it does not."""
    size, me = group.size(), group.rank()
    steps = 60
    grads = [rank_grads(r, 0, [(8, 6)]) for r in range(size)]
    true = sum(g[0] for g in grads) / size

    def run(use_error_feedback):
        state = PowerSGDState(group, 1, start_powerSGD_iter=2,
                              use_error_feedback=use_error_feedback)
        state.iter = 2
        applied = np.zeros_like(true)
        for _ in range(steps):
            applied += run_hook(powerSGD_hook, state, grads[me])[0]
        return state, applied

    state, applied = run(True)
    error = np.array(state.error_dict[0]).reshape(true.shape)
    dist.all_reduce(error, group=group)
    np.testing.assert_allclose(applied, steps * true - error / size, rtol=1e-9, atol=1e-9)
    drift = np.linalg.norm(applied - steps * true) / np.linalg.norm(steps * true)
    assert drift < 0.1, drift
    _, applied_without = run(False)
    drift_without = np.linalg.norm(applied_without - steps * true) / np.linalg.norm(steps * true)
    assert drift_without > 0.3, drift_without  # rank 1 of a random 8 x 6 matrix misses much


@mpi
def test_batch_tensors_with_same_shape_gives_the_same_numbers(group):
    me = group.rank()
    shapes = [(6, 5), (4,), (6, 5), (3, 8), (6, 5)]
    results = []
    for batch in (False, True):
        state = PowerSGDState(group, 1, start_powerSGD_iter=2, random_seed=1,
                              batch_tensors_with_same_shape=batch)
        state.iter = 2
        outs = []
        for step in range(3):
            outs.append(run_hook(powerSGD_hook, state, rank_grads(me, step, shapes)))
        results.append(outs)
        assert state.q_memory_dict[0].size == 3 * 5 + 8
    for a, b in zip(*results):
        assert_close(a, b, 1e-12)


@mpi
def test_batched_powersgd_hook_matches_numpy_reference(group):
    """The whole bucket as one zero-padded square matrix (10 elements -> 4 x 4)."""
    size, me = group.size(), group.rank()
    shapes = [(2, 3), (4,)]
    state = PowerSGDState(group, 1, start_powerSGD_iter=2, random_seed=4)
    state.iter = 2
    seeds = np.random.RandomState(4)
    q = np.random.RandomState(seeds.randint(1_000_000_000)).standard_normal((4, 1))
    errors = [np.zeros(16) for _ in range(size)]
    for step in range(3):
        grads = [rank_grads(r, step, shapes) for r in range(size)]
        ms = [np.concatenate([np.ravel(g) for g in grads[r]] + [np.zeros(6)]) + errors[r]
              for r in range(size)]
        q = orthonormal(q)
        p = orthonormal(sum(m.reshape(4, 4) @ q for m in ms))
        q = sum(m.reshape(4, 4).T @ p for m in ms) / size
        want = (p @ q.T).ravel()
        errors = [m - want for m in ms]
        got = run_hook(batched_powerSGD_hook, state, grads[me])
        assert_close(got, unflatten(want[:10], shapes))
        assert_close([state.error_dict[0]], [errors[me]])


# --- with DDP ----------------------------------------------------------------------------------
def mlp(seed):
    hg.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                         nn.Linear(12, 3)).double()


def train(group, hook_state, steps, seed=0):
    model = DDP(mlp(seed), process_group=group)
    if hook_state is not None:
        model.register_comm_hook(hook_state, powerSGD_hook)
    rng = np.random.default_rng(group.rank())
    grads = []
    for _ in range(steps):
        x = hg.tensor(rng.standard_normal((4, 6)))
        model.zero_grad()
        (model(x) ** 2).sum().backward()
        grads.append([np.array(p.grad.array) for p in model.parameters()])
    return grads


@mpi
def test_vanilla_iterations_equal_plain_ddp(group):
    state = PowerSGDState(group, 1, start_powerSGD_iter=4)
    hooked, plain = train(group, state, 4), train(group, None, 4)
    for a, b in zip(hooked, plain):
        assert_close(a, b, 1e-13)
    assert state.iter == 4 and not state.error_dict and state.compression_stats()[1] == 0


@mpi
def test_ddp_with_powersgd_keeps_ranks_in_step_and_counts_bytes(group):
    """After the vanilla steps the compressed gradients are the same on every rank; the bytes
    sent per step are those counted by hand for this model at rank 1."""
    state = PowerSGDState(group, 1, start_powerSGD_iter=2)
    grads = train(group, state, 5)
    everyone = group.comm.allgather(grads[-1])
    for other in everyone:
        assert_close(other, grads[-1], 0)
    assert state.iter == 5
    # Linear(6,16).weight 16x6: (16+6)*2 < 96, sent as 22; Linear(16,12).weight 12x16: 28;
    # Linear(12,3).weight 3x12: 15*2 = 30 < 36, sent as 15; the biases 16+12+3 uncompressed.
    sent = 22 + 28 + 15 + 31
    assert state.bytes_per_step == 8 * sent
    assert state.bytes_uncompressed_per_step == 8 * (96 + 16 + 192 + 12 + 36 + 3)
    rate, before, after = state.compression_stats()
    assert (before, after) == (3 * 355, 3 * sent) and rate == pytest.approx(355 / sent)


@mpi
@pytest.mark.parametrize("warm_start", [True, False])
def test_hook_parity_with_allreduce_where_nothing_compresses(group, warm_start):
    """PyTorch's test_ddp_hook_parity_powerSGD: Linear(1, 5) (a 5 x 1 weight, never worth
    compressing) fed [rank]: the hooked DDP's weight gradient equals plain DDP's and the mean
    rank at every iteration, well past start_powerSGD_iter (PyTorch: 100; here 20)."""
    size, me = group.size(), group.rank()
    hg.manual_seed(0)
    hooked = DDP(nn.Linear(1, 5), process_group=group)
    hg.manual_seed(0)
    plain = DDP(nn.Linear(1, 5), process_group=group)
    hooked.register_comm_hook(PowerSGDState(group, 1, start_powerSGD_iter=2,
                                            warm_start=warm_start), powerSGD_hook)
    expected = sum(range(size)) / size
    for _ in range(20):
        grads = []
        for net in (plain, hooked):
            net.zero_grad()
            net(hg.tensor([[float(me)]])).sum().backward()
            grads.append(np.array(net.module.weight.grad.array))
        assert grads[1][0, 0] == pytest.approx(expected) and np.array_equal(grads[0], grads[1])


@mpi
def test_several_buckets_with_the_progress_thread(group, monkeypatch):
    """Note [PowerSGD collectives in one order]: three buckets, the progress thread completing
    the vanilla steps' all-reduces (and running their callbacks) while backward launches the
    next bucket's; the compressed steps' collectives all start on the training thread. Every
    rank ends with the gradients of the same run without the thread."""
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 100 << 10)  # as later ones

    def run(thread):
        hg.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                            nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)).double()
        ddp = DDP(net, process_group=group, bucket_cap_mb=0.1)
        state = PowerSGDState(group, 2, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook)
        rng = np.random.default_rng(group.rank())
        if thread:
            dist.start_progress_thread(interval=1e-4)
        try:
            for _ in range(5):
                ddp.zero_grad()
                (ddp(hg.tensor(rng.standard_normal((8, 32)))) ** 2).sum().backward()
        finally:
            dist.stop_progress_thread()
        assert len(ddp.reducer.buckets) == 3 and state.iter == 5
        return [np.array(p.grad.array) for p in net.parameters()]

    for a, b in zip(run(True), run(False)):
        np.testing.assert_array_equal(a, b)


# --- serial: arguments, helpers, errors --------------------------------------------------------
@pytest.mark.parametrize("start", [0, 1])
@pytest.mark.parametrize("use_error_feedback, warm_start", [(True, True), (True, False),
                                                            (False, True)])
def test_state_refuses_start_before_bucket_rebuild(start, use_error_feedback, warm_start):
    """PyTorch's test_invalid_powerSGD_state."""
    with pytest.raises(ValueError, match="Expect `start_powerSGD_iter` > 1 if `use_error_feedback` "
                                         "or `warm_start` is enabled, because PowerSGD can only be "
                                         "applied after the first two iterations in DDP"):
        PowerSGDState(None, start_powerSGD_iter=start, use_error_feedback=use_error_feedback,
                      warm_start=warm_start)


def test_state_arguments():
    PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    with pytest.raises(ValueError, match="matrix_approximation_rank must be a positive"):
        PowerSGDState(None, matrix_approximation_rank=0)


def test_defaults_are_pytorchs():
    state = PowerSGDState(None)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter,
            state.min_compression_rate, state.use_error_feedback, state.warm_start,
            state.orthogonalization_epsilon, state.compression_stats_logging_frequency,
            state.batch_tensors_with_same_shape) == (1, 1000, 2, True, True, 0, 10_000, False)


def test_should_compress():
    assert _should_compress(6, 5, 1, 2) == (True, 30, 11)
    assert _should_compress(2, 3, 1, 2) == (False, 6, 5)
    assert _should_compress(100, 1, 1, 1) == (False, 100, 101)  # a vector never shrinks


def test_orthogonalize_equals_qr_up_to_signs_and_keeps_zero_columns():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 7, 3))
    got = a.copy()
    _orthogonalize(got)
    for g, m in zip(got, a):
        q = np.linalg.qr(m)[0]
        np.testing.assert_allclose(np.abs(g), np.abs(q), atol=1e-12)
    zero = np.zeros((1, 4, 1))
    _orthogonalize(zero)
    assert np.all(zero == 0)  # PyTorch's epsilon=0 would give NaN here
    eps = a[:1].copy()
    _orthogonalize(eps, epsilon=1e-3)
    assert np.linalg.norm(eps[0, :, 0]) == pytest.approx(1 / (1 + 1e-3 / np.linalg.norm(a[0, :, 0])))


def test_hooks_refuse_sparse_buckets():
    bucket = type("SparseBucket", (), {"is_sparse": lambda self: True})()
    for hook in (powerSGD_hook, batched_powerSGD_hook):
        with pytest.raises(NotImplementedError, match="use allreduce_hook"):
            hook(PowerSGDState(None), bucket)


def test_changed_bucket_after_start_is_an_error(world):
    state = PowerSGDState(None, 1, start_powerSGD_iter=2)
    state.iter = 2
    run_hook(powerSGD_hook, state, [np.ones((6, 5))])
    with pytest.raises(RuntimeError, match="buckets changed after PowerSGD started"):
        run_hook(powerSGD_hook, state, [np.ones((6, 7))])


def test_pytorch_import_paths():
    from hpcgrad.distributed.algorithms.ddp_comm_hooks import default_hooks
    from hpcgrad.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as module
    assert module.powerSGD_hook is comm_hooks.powerSGD_hook is powerSGD_hook
    assert module.PowerSGDState is comm_hooks.PowerSGDState
    assert default_hooks.allreduce_hook is comm_hooks.allreduce_hook


# --- PyTorch's own hook --------------------------------------------------------------------------
def test_ddp_steps_equal_pytorchs_powersgd_hook(world):
    """One process each (gloo for torch): 6 steps of the same double-precision MLP and inputs,
    vanilla for 2, then PowerSGD rank 1 with error feedback and warm start; both start from
    the same injected Q (the random draws differ: numpy's generator is not torch's). Only
    Linear(8, 6).weight compresses. Gradients after each step agree to rounding."""
    torch = pytest.importorskip("torch")
    import socket

    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tpsgd
    if not tdist.is_available() or not tdist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal((6, 8)), rng.standard_normal(6), rng.standard_normal((1, 6)),
               rng.standard_normal(1)]
    inputs = [rng.standard_normal((5, 8)) for _ in range(6)]
    q0 = rng.standard_normal((8, 1))

    ours = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    for p, w in zip(ours.parameters(), weights):
        p.array[...] = w
    ddp = DDP(ours, process_group=world)
    state = PowerSGDState(world, 1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                             world_size=1)
    tddp = tstate = None
    try:
        theirs = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(),
                                     torch.nn.Linear(6, 1)).double()
        with torch.no_grad():
            for p, w in zip(theirs.parameters(), weights):
                p.copy_(torch.from_numpy(w))
        tddp = torch.nn.parallel.DistributedDataParallel(theirs)
        tstate = tpsgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        tddp.register_comm_hook(tstate, tpsgd.powerSGD_hook)
        for step, x in enumerate(inputs):
            if step == 2:  # the first compressed step: both warm-start from q0
                state.p_memory_dict, state.q_memory_dict = {0: np.zeros(6)}, {0: q0.ravel().copy()}
                tstate.p_memory_dict = {0: torch.zeros(6, dtype=torch.float64)}
                tstate.q_memory_dict = {0: torch.from_numpy(q0.ravel().copy())}
            ddp.zero_grad()
            (ddp(hg.tensor(x)) ** 2).sum().backward()
            tddp.zero_grad()
            (tddp(torch.from_numpy(x)) ** 2).sum().backward()
            for p, t in zip(ours.parameters(), theirs.parameters()):
                np.testing.assert_allclose(p.grad.array, t.grad.numpy(), rtol=1e-10, atol=1e-12,
                                           err_msg=f"step {step}")
            with hg.no_grad():  # an SGD step on both, so the steps see new weights
                for p in ours.parameters():
                    p.array -= 0.1 * p.grad.array
            with torch.no_grad():
                for t in theirs.parameters():
                    t -= 0.1 * t.grad
        assert state.iter == tstate.iter == 6
        assert state.compression_stats()[1:] == tstate.compression_stats()[1:] == (4 * 61, 4 * 27)
    finally:
        # torch's DDP (its reducer holds the gloo group) and the hook's state go first, on this
        # thread, while the group lives: left to the collector, one was freed during a later
        # test on a native thread that then joined itself, and the process aborted ("Resource
        # deadlock avoided", CI of 2026-11-29)
        tddp = tstate = None
        gc.collect()
        tdist.destroy_process_group()


def test_state_pickles_without_its_process_group(world):
    """As PyTorch's __getstate__: the group stays behind (None: the default group after
    unpickling), the hyperparameters and the per-bucket memory travel."""
    import pickle
    state = PowerSGDState(world, 1, start_powerSGD_iter=2)
    state.iter = 2
    run_hook(powerSGD_hook, state, [np.arange(30.0).reshape(6, 5)])
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and copy.iter == 3 and copy.start_powerSGD_iter == 2
    for a, b in ((state.error_dict, copy.error_dict), (state.q_memory_dict, copy.q_memory_dict)):
        assert np.array_equal(a[0], b[0])
    assert copy.rng.randint(1000) == state.rng.randint(1000)
