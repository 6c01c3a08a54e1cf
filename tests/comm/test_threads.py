"""Threads per rank (comm/threads.py, Note [Threads per rank]): the share each rank takes, what
the user set left alone, and after init_process_group the BLAS pool at that size."""

import sys

import pytest

from hpcgrad.comm.threads import threads_per_rank


@pytest.mark.parametrize("ranks, cpus, affinity, expected", [
    (1, 8, 8, None),   # one rank per node: the defaults stand
    (2, 2, 2, 1),      # a 2-core laptop, mpiexec -n 2
    (4, 16, 16, 4),
    (3, 16, 16, 5),
    (32, 16, 16, 1),   # more ranks than cores: one thread each
    (4, 64, 8, 8),     # bound by the launcher to 8 cores: those are this rank's
])
def test_each_rank_takes_its_share_of_the_cores(ranks, cpus, affinity, expected):
    assert threads_per_rank(ranks, {}, cpus, affinity) == expected


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                  "NUMBA_NUM_THREADS"])
def test_a_variable_the_user_set_is_left_alone(name):
    assert threads_per_rank(4, {name: "3"}, 16, 16) is None


def test_hpcgrad_threads_per_rank_sets_it_outright_and_a_bad_value_is_named():
    assert threads_per_rank(1, {"HPCGRAD_THREADS_PER_RANK": "3"}, 16, 16) == 3
    with pytest.raises(ValueError, match=r"HPCGRAD_THREADS_PER_RANK must be a positive number of "
                                         r"threads \(unset: .*\), got 'many'"):
        threads_per_rank(2, {"HPCGRAD_THREADS_PER_RANK": "many"}, 16, 16)


def test_two_ranks_on_a_node_run_their_share_of_blas_threads(launch):
    """A launched 2-rank job (no thread variables): after init_process_group each rank's BLAS
    pool holds the share threads_per_rank computes, and numba's pool too."""
    script = (
        "import os\n"
        "from threadpoolctl import threadpool_info\n"
        "import hpcgrad.distributed as dist\n"
        "from hpcgrad.comm.threads import threads_per_rank\n"
        "want = threads_per_rank(2)  # before: init sets NUMBA_NUM_THREADS\n"
        "dist.init_process_group()\n"
        "blas = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas']\n"
        "import numba\n"
        "assert blas and all(n == want for n in blas), (blas, want)\n"
        "assert numba.get_num_threads() == min(want, numba.config.NUMBA_NUM_THREADS)\n"
        "print('SHARE', want, flush=True)\n")
    env = {name: "" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                 "NUMBA_NUM_THREADS", "HPCGRAD_THREADS_PER_RANK")}
    job = launch([sys.executable, "-c", script], nprocs=2, timeout=120, env=env)
    assert not job.failed and job.stdout.count("SHARE") == 2, job.output
