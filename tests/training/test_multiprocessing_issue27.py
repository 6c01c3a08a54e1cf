"""hpcgrad.multiprocessing.spawn (Note [spawn over MPI]): PyTorch's mp.spawn launcher line runs
unchanged, as plain python (spawn starts mpiexec) and under mpiexec (the ranks are the workers)."""

import re
import sys
import textwrap

import pytest

from launching import run_job

SCRIPT = textwrap.dedent("""
    import sys
    import hpcgrad as torch
    import hpcgrad.distributed as dist
    import hpcgrad.multiprocessing as mp

    def work(rank, world, fail_rank):
        dist.init_process_group("gloo", rank=rank, world_size=world)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        print(f"worker {rank} of {dist.get_world_size()} sum {t.item():g}", flush=True)
        dist.destroy_process_group()
        if rank == fail_rank:
            sys.exit(3)

    if __name__ == "__main__":
        nprocs, fail_rank = int(sys.argv[1]), int(sys.argv[2])
        mp.spawn(work, args=(nprocs, fail_rank), nprocs=nprocs, join=True)
        print("after spawn", flush=True)
""")


def _workers(stdout):
    return re.findall(r"worker \d+ of \d+ sum \d+", stdout)  # ranks' lines may interleave


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("spawn") / "spawn_script.py"
    path.write_text(SCRIPT)
    return str(path)


def test_plain_python_spawns_the_ranks_and_only_the_parent_goes_on(script):
    job = run_job([sys.executable, script, "3", "-1"], timeout=90)
    assert job.returncode == 0, job.output
    workers = sorted(_workers(job.stdout))
    assert workers == [f"worker {r} of 3 sum 6" for r in range(3)]
    assert job.stdout.count("after spawn") == 1  # the children leave after fn, as PyTorch's


def test_a_failed_rank_raises_process_exited_in_the_parent(script):
    job = run_job([sys.executable, script, "2", "1"], timeout=90)
    assert job.returncode != 0
    assert "ProcessExitedException: process terminated with exit code 3" in job.stderr
    assert "after spawn" not in job.stdout


def test_under_mpiexec_each_rank_is_a_worker_and_nprocs_must_match(script):
    job = run_job([sys.executable, script, "2", "-1"], nprocs=2, timeout=90)
    assert job.returncode == 0, job.output
    assert sorted(_workers(job.stdout)) == [
        "worker 0 of 2 sum 3", "worker 1 of 2 sum 3"]
    wrong = run_job([sys.executable, script, "3", "-1"], nprocs=2, timeout=90)
    assert wrong.returncode != 0
    assert "spawn(nprocs=3) in a job of 2 MPI ranks" in wrong.stderr
    assert "mpiexec -n 3" in wrong.stderr


def test_nprocs_is_checked_and_pythons_multiprocessing_is_reexported():
    import multiprocessing

    import hpcgrad.multiprocessing as mp
    assert mp.Process is multiprocessing.Process and mp.Queue is multiprocessing.Queue
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        mp.spawn(print, nprocs=0)
    seen = []
    mp.spawn(lambda rank, x: seen.append((rank, x)), args=("a",), nprocs=1)
    assert seen == [(0, "a")]
