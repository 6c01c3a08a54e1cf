"""hpcgrad.distributed.elastic: training that goes on when ranks are lost, on fault-tolerant MPI
(ULFM) alone, with no agent or store to run beside the job (Note [Elastic run] in runner.py).

    state = elastic.State(model, optimizer, sampler=elastic.ElasticSampler(data, size, rank))

    @elastic.run(min_size=2, on_change=print)
    def train(state):
        while state.epoch < epochs:
            ...  # forward with state.ddp, step, state.sampler.record_batch(n), state.step += 1
            state.commit()

Launch with ``mpirun --with-ft ulfm --mca btl tcp,self --mca pml ob1`` from the ``ft`` extra;
docs/elastic.rst says what is protected and what is not.
"""

from hpcgrad.comm.ulfm import ProcessFailure, RecoveryTimeoutError  # noqa: F401
from hpcgrad.elastic.runner import LeaveRequest, WorldTooSmallError, run  # noqa: F401
from hpcgrad.elastic.sampler import ElasticSampler  # noqa: F401
from hpcgrad.elastic.state import State  # noqa: F401
from hpcgrad.elastic.world import WorldChange  # noqa: F401
