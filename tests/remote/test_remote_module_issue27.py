"""RemoteModule as PyTorch's (issue 27): a module built and run on another worker, with
distributed autograd through its forward and DistributedOptimizer over its remote_parameters.

The last test is PyTorch's distributed/rpc/ddp_rpc pattern (an EmbeddingBag on a parameter
server, used by trainers), checked against the same steps computed with torch in one process.
"""

import importlib.util

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
from hpcgrad import optim
from hpcgrad.distributed.nn import RemoteModule
from hpcgrad.distributed.nn.api.remote_module import RemoteModule as ApiRemoteModule
from hpcgrad.distributed.optim import DistributedOptimizer

from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)


def training_of(module_rref):
    return module_rref.local_value().training


def driver():
    return rank_and_size()[0] == 0


def linear(seed):
    rng = np.random.default_rng(seed)
    model = hg.nn.Linear(4, 3).double()
    model.weight.array[...] = rng.standard_normal((3, 4))
    model.bias.array[...] = rng.standard_normal(3)
    return model


def test_both_import_paths_name_one_class():
    assert ApiRemoteModule is RemoteModule
    import hpcgrad.distributed.nn as dnn  # the differentiable collectives stay where they were
    assert callable(dnn.all_reduce) and callable(dnn.all_to_all)


@pytest.mark.mpi(min_size=2)
def test_forward_runs_on_the_remote_worker():
    if not driver():
        return
    x = hg.tensor(np.random.default_rng(0).standard_normal((2, 4)))
    for remote_device in ("worker1/cpu", "rank:1/cpu", "worker1"):
        rm = RemoteModule(remote_device, linear, args=(7,))
        assert rm.get_module_rref().owner() == rpc.WorkerInfo("worker1", 1)
        weight, bias = (p.to_here().array for p in rm.remote_parameters())
        expected = x.array @ weight.T + bias
        np.testing.assert_allclose(rm.forward(x).array, expected, rtol=1e-12)
        np.testing.assert_allclose(rm(x).array, expected, rtol=1e-12)
        np.testing.assert_allclose(rm.forward_async(x).wait(WAIT_LIMIT).array, expected,
                                   rtol=1e-12)
    assert np.array_equal(weight, linear(7).weight.array)  # built there from the same seed
    # train()/eval() set the remote module's mode
    assert rm.eval() is rm and not rm.training
    assert rpc.rpc_sync(1, training_of, args=(rm.get_module_rref(),)) is False
    assert rm.train() is rm and rm.training
    assert rpc.rpc_sync(1, training_of, args=(rm.get_module_rref(),)) is True


@pytest.mark.mpi(min_size=2)
def test_a_remote_module_travels_in_an_rpc():
    """The ddp_rpc example sends its RemoteModule to the trainers."""
    if not driver():
        return
    rm = RemoteModule("worker1/cpu", linear, args=(3,))
    x = hg.tensor(np.ones((1, 4)))
    there = rpc.rpc_sync(1, call_forward, args=(rm, x))
    np.testing.assert_allclose(there.array, rm(x).array, rtol=1e-12)


def call_forward(rm, x):
    return rm.forward(x)


@pytest.mark.mpi(min_size=2)
def test_unsupported_methods_raise_as_pytorch():
    if not driver():
        return
    rm = RemoteModule("worker1/cpu", linear, args=(1,))
    with pytest.raises(ValueError, match=r"^Method ``parameters`` not supported for RemoteModule\. "
                                         r"Please use ``remote_parameters`` instead\.$"):
        rm.parameters()
    calls = {"named_parameters": (), "buffers": (), "children": (), "modules": (),
             "named_modules": (), "to": ("cpu",), "cuda": (), "cpu": (), "double": (),
             "state_dict": (), "load_state_dict": ({},), "zero_grad": (), "apply": (print,),
             "register_forward_hook": (print,), "add_module": ("m", None),
             "requires_grad_": (), "extra_repr": ()}
    for name, args in calls.items():
        with pytest.raises(ValueError, match=rf"^Method ``{name}`` not supported for "
                                             rf"RemoteModule$"):
            getattr(rm, name)(*args)


@pytest.mark.mpi(min_size=2)
def test_construction_errors_say_what_to_give():
    if not driver():
        return
    for bad in ("worker1/cpu/0", "/cpu", "rank:x/cpu", "worker1/", "worker1/gpu"):
        with pytest.raises(ValueError, match=rf"^Could not parse remote_device: '{bad}'\. The "
                                             rf"valid format is '<workername>/<device>' or "
                                             rf"'rank:<rank>/<device>'"):
            RemoteModule(bad, linear, args=(1,))
    with pytest.raises(RuntimeError, match="^Unknown destination worker nobody: "):
        RemoteModule("nobody/cpu", linear, args=(1,))
    with pytest.raises(ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an "
                                         r"instance of <class nn.Module>, but it returns an "
                                         r"instance of <class 'dict'>\."):
        RemoteModule("worker1/cpu", dict)
    with pytest.raises(TypeError, match=r"rank 1\).*missing 1 required positional argument"):
        RemoteModule("worker1/cpu", linear)
    if importlib.util.find_spec("cupy") is None:  # no GPU possible on worker1
        with pytest.raises(RuntimeError, match=r"RemoteModule: cannot place Linear on cuda:0 of "
                                               r"worker1 \(rank 1\): Torch not compiled with CUDA "
                                               r"enabled.*cuda:0.*give remote_device 'worker1/cpu'"):
            RemoteModule("worker1/cuda:0", linear, args=(1,))


# --- PyTorch's distributed/rpc/ddp_rpc pattern ---------------------------------------------------
NUM_EMBEDDINGS, EMBEDDING_DIM, CLASSES, STEPS, LR = 10, 4, 3, 2, 0.05


def fc_of(rank):
    rng = np.random.default_rng(100 + rank)
    fc = hg.nn.Linear(EMBEDDING_DIM, CLASSES).double()
    fc.weight.array[...] = rng.standard_normal((CLASSES, EMBEDDING_DIM))
    fc.bias.array[...] = rng.standard_normal(CLASSES)
    return fc


def batch_of(rank, step):
    """(indices, offsets, target): three bags of a trainer's step."""
    rng = np.random.default_rng(1000 * rank + step)
    indices = rng.integers(0, NUM_EMBEDDINGS, 7)
    return indices, np.array([0, 2, 5]), rng.integers(0, CLASSES, 3)


class HybridModel(hg.nn.Module):
    """The example's: the EmbeddingBag on the parameter server, a Linear here (no DDP: the
    trainers run one after another, so the steps have one order to compare with)."""

    def __init__(self, remote_emb_module, rank):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = fc_of(rank)

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def run_trainer(remote_emb_module):
    rank, _ = rank_and_size()
    model = HybridModel(remote_emb_module, rank)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(rpc.RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=LR)
    criterion = hg.nn.CrossEntropyLoss()
    for step in range(STEPS):
        indices, offsets, target = batch_of(rank, step)
        with dist_autograd.context() as context_id:
            output = model(hg.tensor(indices), hg.tensor(offsets))
            loss = criterion(output, hg.tensor(target))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
    return [p.array.copy() for p in model.fc.parameters()]


@pytest.mark.mpi(min_size=2)
def test_ddp_rpc_example_embedding_bag_on_a_parameter_server():
    """The last rank is the parameter server; every other rank (rank 0, the master, too) a
    trainer, one after another. The table's and each trainer's Linear's updated values match
    the same steps taken with torch in one process."""
    rank, size = rank_and_size()
    if rank != 0:
        return
    ps = size - 1
    remote_emb_module = RemoteModule(f"worker{ps}/cpu", hg.nn.EmbeddingBag,
                                     args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                     kwargs={"mode": "sum", "dtype": np.float64})
    table = remote_emb_module.remote_parameters()[0]
    initial = table.to_here().array.copy()
    trainers = list(range(ps))
    fcs = {t: rpc.rpc_sync(t, run_trainer, args=(remote_emb_module,), timeout=WAIT_LIMIT)
           for t in trainers}

    torch = pytest.importorskip("torch")
    emb = torch.nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum").double()
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(initial))
    for t in trainers:
        ref_fc = torch.nn.Linear(EMBEDDING_DIM, CLASSES).double()
        with torch.no_grad():
            ref_fc.weight.copy_(torch.from_numpy(fc_of(t).weight.array))
            ref_fc.bias.copy_(torch.from_numpy(fc_of(t).bias.array))
        opt = torch.optim.SGD([emb.weight, *ref_fc.parameters()], lr=LR)
        for step in range(STEPS):
            indices, offsets, target = batch_of(t, step)
            opt.zero_grad()
            out = ref_fc(emb(torch.from_numpy(indices), torch.from_numpy(offsets)))
            torch.nn.functional.cross_entropy(out, torch.from_numpy(target)).backward()
            opt.step()
        np.testing.assert_allclose(fcs[t][0], ref_fc.weight.detach().numpy(), rtol=1e-10)
        np.testing.assert_allclose(fcs[t][1], ref_fc.bias.detach().numpy(), rtol=1e-10)
    updated = table.to_here().array
    assert not np.allclose(updated, initial)
    np.testing.assert_allclose(updated, emb.weight.detach().numpy(), rtol=1e-10)
