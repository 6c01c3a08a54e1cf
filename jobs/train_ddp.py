"""Data-parallel training of a small CNN or MLP on scikit-learn's digits, with resumable checkpoints.

    mpiexec -n 2 python jobs/train_ddp.py                  # train (a few seconds)
    mpiexec -n 2 python jobs/train_ddp.py --resume         # continue from checkpoints/last.npz
    sbatch slurm/train_ddp.sbatch                          # on a cluster
    .venv-ft/bin/mpirun --with-ft ulfm --mca btl tcp,self --mca pml ob1 -n 4 \
        python jobs/train_ddp.py --elastic                 # survive lost ranks (docs/elastic.rst)

Each rank trains on its DistributedSampler shard; DistributedDataParallel averages gradients.
Rank 0 prints a header and one line per epoch (train loss, test loss and accuracy over every test
sample once, time, samples/s), shows a progress bar on a terminal, appends to
<checkpoint-dir>/metrics.jsonl (``python -m hpcgrad.plot <checkpoint-dir>`` draws it), and saves
checkpoints atomically every --checkpoint-every steps and at the end of each epoch. On SIGTERM,
SIGUSR1 or SIGINT (preemption, Ctrl-C) all ranks stop at the next step after a final checkpoint,
rank 0 leaves <checkpoint-dir>/PREEMPTED and the job exits with 128 + the signal's number
(jobs/job_args.py: the exit statuses), so --resume (or slurm/train_ddp.sbatch's requeue)
continues exactly where the job stopped. With --elastic (fault-tolerant MPI) the job goes on
without ranks that die, from an in-memory commit, and the survivors' rank 0 takes over rank 0's
roles (Note [Elastic training loop]). HPCGRAD_TIMELINE=path records a timeline of every rank.
The loop around the step is hpcgrad.training's (Note [One training loop]); this file is the
model, the data, one step and the evaluation.
"""

from job_args import add_elastic_arguments, add_run_arguments, parse_together, real, \
    training_parser

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad import optim
from hpcgrad.comm.mpi import MPI, cuda_aware_mpi
from hpcgrad import elastic
from hpcgrad.data import DataLoader, load_digits
from hpcgrad.nn.parallel import DistributedDataParallel
from hpcgrad.base.timeline import TIMELINE
from hpcgrad.training.elastic_loop import ElasticLoop
from hpcgrad.training.loop import (EvaluationShard, Job, Loop, check_setup, counted, evaluate,
                                   exit_job, hosts, loaders, rank_places, say, start,
                                   stop_if_any)

PROG = "train_ddp.py"


def build_model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 16 x 4 x 4
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 32 x 2 x 2
        nn.Flatten(), nn.Linear(128, 10))


def parse_args(argv=None):
    p = training_parser(__doc__.splitlines()[0], epochs=8, batch_help="samples per rank and step",
                        lr_help="SGD learning rate",
                        seed_help="seed of the weights and the sampler")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="the network")
    p.add_argument("--bucket-cap-mb", type=real("DDP's bucket size in MB", 25, positive=True),
                   default=25, help="DDP's bucket size")
    add_run_arguments(p, checkpoint_dir="checkpoints",
                      checkpoint_help="checkpoints and metrics.jsonl of the run",
                      resume_help="continue from <checkpoint-dir>/last.npz")
    add_elastic_arguments(p)
    return parse_together(p, argv)


def header(args, world, train, test):
    """The run's set-up in a few lines (rank 0 prints it)."""
    places = hosts()
    nodes = sorted({host for host, _ in places})
    return (f"hpcgrad DDP job: {counted(world, 'rank')} on {counted(len(nodes), 'node')}; "
            f"model {args.model}; global batch {args.batch_size * world} ({args.batch_size} per "
            f"rank); lr {args.lr}; momentum {args.momentum}; epochs {args.epochs}\n"
            f"data: {len(train)} train / {len(test)} test samples; MPI: "
            f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}; CUDA-aware: "
            f"{cuda_aware_mpi()[0]}; checkpoints and metrics.jsonl in {args.checkpoint_dir}\n"
            f"ranks: {rank_places(places)}\n"
            f"arguments: {' '.join(f'{k}={v}' for k, v in sorted(vars(args).items()))}")


def ddp_summary(model):
    """One line from DDP's logging data (PyTorch's _get_ddp_logging_data), after some steps."""
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data["bucket_sizes"]
    unused = ", ".join(data["unused_parameter_names"]) or "none"
    return (f"DDP: {data['num_buckets']} bucket(s) of {', '.join(f'{b / 2**20:.3f}' for b in sizes)} MB"
            f" ({'rebuilt in gradient order' if data['has_rebuilt_buckets'] else 'not rebuilt'}), "
            f"comm hook {data['comm_hook']}, unused parameters {unused}; per step on rank 0: "
            f"backward {data['avg_backward_compute_time'] / 1e6:.1f} ms, all-reduce "
            f"{data['avg_backward_comm_time'] / 1e6:.1f} ms, overlapped "
            f"{data['avg_backward_compute_comm_overlap_time'] / 1e6:.1f} ms")


def resume_problem(meta, path, world, elastic_run=False):
    """Why the checkpoint cannot continue at this world size, or None: a run stopped mid-epoch
    continues only on the shards it was cut into (an epoch's end, at any size), unless it is
    elastic (its sampler deals the rest of the epoch over any world)."""
    start_epoch, skip = meta["epoch"], meta["batches_done"]
    saved_world = int(meta.get("world_size", world))
    if elastic_run or not skip:
        return None
    if "sampler_processed" in meta:
        return (f"{path} was saved by an --elastic run in the middle of epoch "
                f"{start_epoch + 1}, whose place in the epoch only --elastic reads; resume "
                "with --elastic")
    if saved_world == world:
        return None
    return (f"{path} was saved by {saved_world} ranks in the middle of epoch {start_epoch + 1} "
            f"(after {skip} of its steps); at {world} ranks the epoch's shards differ, so it "
            f"cannot continue exactly. Resume with {saved_world} ranks, or start a new run "
            "(another --checkpoint-dir)")


class Digits(Job):
    """The digits classifier: cross-entropy, SGD with momentum, DDP."""

    prog = PROG

    def __init__(self, args, model, optimizer, sampler, train_loader, test_loader):
        self.args, self.model, self.optimizer = args, model, optimizer
        self.sampler, self.train_loader, self.test_loader = sampler, train_loader, test_loader

    def batches(self, epoch):
        self.sampler.set_epoch(epoch)
        return self.train_loader

    def step(self, batch, step):
        images, labels = batch
        with TIMELINE.span("forward", "step", step=step):
            loss = F.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad()
        with TIMELINE.span("backward", "step", step=step):
            loss.backward()
        with TIMELINE.span("optimizer step", "step", step=step):
            self.optimizer.step()
        return loss.item(), len(labels.array), {}

    def end_epoch(self, epoch):
        test_loss, accuracy = evaluate(self.model, self.test_loader, F.cross_entropy)
        return ({"test_loss": test_loss, "test_accuracy": accuracy},
                f"test loss {test_loss:.4f}  test accuracy {accuracy:.4f}")

    def restore(self, meta):
        saved_world, world = int(meta.get("world_size", dist.get_world_size())), \
            dist.get_world_size()
        if saved_world != world and dist.get_rank() == 0:
            where = (f"where epoch {meta['epoch'] + 1} stopped, its rest dealt over {world} ranks"
                     if self.args.elastic else f"from the start of epoch {meta['epoch'] + 1}")
            print(f"note: the checkpoint was saved by {saved_world} ranks; continuing at {world} "
                  f"{where} (global batch now {self.args.batch_size * world})", flush=True)

    def first_epoch_note(self):
        return ddp_summary(self.model)

    def world_changed(self, state, change):
        """--elastic: the survivors' DDP, and the test set dealt over them."""
        self.model = state.ddp
        test = self.test_loader.dataset
        shard = EvaluationShard(len(test), dist.get_rank(), dist.get_world_size())
        self.test_loader = DataLoader(test, batch_size=256, sampler=shard)


def main(argv=None):
    args = parse_args(argv)
    rank, world, checkpoints = start(
        args, PROG, lambda meta, path, size: resume_problem(meta, path, size, args.elastic))
    hg.manual_seed(args.seed)
    train, test = load_digits("train"), load_digits("test")
    if args.elastic:  # Note [Elastic training loop]
        module = build_model(args.model)
        optimizer = optim.SGD(module.parameters(), lr=args.lr, momentum=args.momentum)
        _, _, test_loader = loaders(args, train, test)
        sampler = elastic.ElasticSampler(train, world, rank, seed=args.seed)
        train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
        state = elastic.State(module, optimizer, sampler=sampler,
                              ddp_kwargs={"bucket_cap_mb": args.bucket_cap_mb})
        model = state.ddp
    else:
        model = DistributedDataParallel(build_model(args.model),
                                        bucket_cap_mb=args.bucket_cap_mb)
        optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        sampler, train_loader, test_loader = loaders(args, train, test)
    stop_if_any(check_setup(args, world, train), PROG, "checking the set-up")
    say(header(args, world, train, test))
    job = Digits(args, model, optimizer, sampler, train_loader, test_loader)
    if args.elastic:
        return ElasticLoop(job, args, state, checkpoints, min_size=args.min_ranks,
                           commit_every=args.commit_every).run()
    return Loop(job, args, model, optimizer, len(train_loader), checkpoints).run()


if __name__ == "__main__":
    exit_job(main())
