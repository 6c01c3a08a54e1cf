"""A job (jobs/train_ddp.py, or $JOB_FAULT_PROGRAM) with one fault at a chosen step: a rank
dies, or ranks leave by plan.

    JOB_FAULT="MODE RANKS STEP [ONCE]" job_fault.py JOB ARGUMENTS...

MODE ``exit`` (``os._exit(9)``) or ``kill9`` (SIGKILL to itself): world ranks RANKS (comma
separated) die at the top of step STEP. MODE ``vanish``: they leave with ``os._exit(0)``, what
the runtime's end of every rank after a lost node's daemon looks like to a batch script
(mpirun's status 0, no rank's verdict); not in a run with --resume. MODE ``leave``: every rank calls ``state.leave(RANKS)``
there instead, the reference a lost rank's run must equal. Only the first time the step is
reached: after a recovery the survivors do it again without a fault. The arguments are the
job's; the job is unchanged otherwise (slurm/train_ddp_elastic.sbatch runs it with JOB=). With
ONCE, a path, a rank that dies first creates that file, and no run of the job that finds it there
(a requeued one) dies again.
"""

import importlib
import os
import signal
import sys
from pathlib import Path

from mpi4py import MPI

JOBS = Path(__file__).resolve().parents[3] / "jobs"
sys.path.insert(0, str(JOBS))  # jobs/ is not a package
program = importlib.import_module(
    Path(os.environ.get("JOB_FAULT_PROGRAM", "train_ddp.py")).stem)

from hpcgrad.training import elastic_loop  # noqa: E402

mode, ranks, fault_step, *once = os.environ["JOB_FAULT"].split()
ranks, fault_step = {int(r) for r in ranks.split(",")}, int(fault_step)
loops, fired = [], []

_init = elastic_loop.ElasticLoop.__init__


def _remember(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    loops.append(self)
    job_step = self.job.step

    def step_with_fault(batch, step):
        _fault(step)
        return job_step(batch, step)
    self.job.step = step_with_fault


def _fault(step):
    if step == fault_step and not fired:
        fired.append(step)
        if mode == "leave":
            loops[0].state.leave(ranks)
        elif mode == "vanish":
            if MPI.COMM_WORLD.Get_rank() in ranks and "--resume" not in sys.argv:
                sys.stdout.flush()
                os._exit(0)
        elif MPI.COMM_WORLD.Get_rank() in ranks and not (once and os.path.exists(once[0])):
            if once:
                open(once[0], "w").close()
            sys.stdout.flush()
            if mode == "exit":
                os._exit(9)
            os.kill(os.getpid(), signal.SIGKILL)


elastic_loop.ElasticLoop.__init__ = _remember
program.exit_job(program.main(sys.argv[1:]))
