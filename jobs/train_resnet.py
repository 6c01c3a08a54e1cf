"""A small ResNet on scikit-learn's digits: SyncBatchNorm, ZeRO, OneCycleLR and, by flag, PowerSGD.

    mpiexec -n 2 python jobs/train_resnet.py                 # train (seconds on a laptop)
    mpiexec -n 2 python jobs/train_resnet.py --powersgd 2    # gradients sent as rank-2 P and Q
    mpiexec -n 2 python jobs/train_resnet.py --resume        # continue from checkpoints-resnet/last.npz

The network: a 3x3 stem, two residual blocks (conv-BN-ReLU-conv-BN plus the shortcut, the
second halving the 8x8 images with a strided 1x1 projection), a global average pool and a
linear layer. Its BatchNorm layers become SyncBatchNorm, so the batch statistics are those of
the global batch: N ranks of --batch-size B train exactly as one rank of N B (up to rounding).
The optimizer is ZeroRedundancyOptimizer over SGD (each rank keeps the momentum of its shard of
the parameters), its lr and momentum driven per step by OneCycleLR (or per epoch by
CosineAnnealingLR). --powersgd RANK registers PowerSGD as DDP's comm hook (plain all-reduce for
the first --powersgd-start steps).

Progress, checkpoints and preemption are hpcgrad.training's loop, as for jobs/train_ddp.py: a
header with the ranks' hosts and pids, one line per epoch on rank 0 (and a bar on a terminal),
<checkpoint-dir>/metrics.jsonl, an atomic checkpoint every --checkpoint-every steps and at each
epoch's end (the model, the ZeRO state consolidated on rank 0, the scheduler and every rank's
PowerSGD memory), and on
SIGTERM/SIGUSR1/SIGINT a checkpoint at the next step, <checkpoint-dir>/PREEMPTED and exit status
128 + the signal's number, so --resume continues exactly where the job stopped. Every rank
restores from the one file rank 0 wrote (it holds every rank's state), so a commit of several
files is not needed here.
"""

import numpy as np
from job_args import add_run_arguments, integer, parse_together, training_parser

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn.functional as F
from hpcgrad import nn, optim
from hpcgrad.data import TensorDataset, load_digits
from hpcgrad.ddp.comm_hooks import PowerSGDState, powerSGD_hook
from hpcgrad.distributed.optim import ZeroRedundancyOptimizer
from hpcgrad.nn.parallel import DistributedDataParallel
from hpcgrad.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR
from hpcgrad.training.loop import (Job, Loop, check_setup, counted, evaluate, exit_job, hosts,
                                   loaders, rank_places, say, start, stop_if_any)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the input (a strided 1x1 conv + BN where the shape changes)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):  # as torchvision's: the ReLUs and the residual add in place
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)  # (Note [Folded in-place ops]: both taken into bn2's Node)
        return F.relu(out, inplace=True)


def build_model(width, arch="small"):
    """small: 1x8x8 -> width x 8 x 8 -> block -> 2 width x 4 x 4 -> pool -> 10 logits.
    resnet18: ResNet-18 for 3x32x32 images (3x3 stem, no max pool, as the CIFAR variants):
    four stages of two blocks, width to 8 width channels, 11.2 M parameters at width 64."""
    if arch == "small":
        return nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10))
    layers = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
              nn.ReLU(inplace=True)]  # in place, as torchvision: folded into the BN (fold.py)
    cin = width
    for stage in range(4):
        cout = width * 2 ** stage
        layers += [BasicBlock(cin, cout, stride=2 if stage else 1), BasicBlock(cout, cout)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def datasets(args):
    """(train, test): the digits as they are (small), upscaled to 3x32x32 (resnet18: each pixel
    a 4x4 block, in three equal channels), or random CIFAR-shaped images with random labels
    for timing (--data synthetic: 2,048 train, 512 test; nothing to learn)."""
    if args.data == "synthetic":
        rng = np.random.default_rng(args.seed)
        made = [TensorDataset(rng.standard_normal((n, 3, 32, 32)).astype(np.float32),
                              rng.integers(0, 10, n)) for n in (2048, 512)]
        return made[0], made[1]
    train, test = load_digits("train"), load_digits("test")
    if args.arch == "small":
        return train, test
    up = []
    for part in (train, test):
        images, labels = (t.array for t in part.tensors)
        big = np.kron(images, np.ones((1, 1, 4, 4), np.float32))  # (N, 1, 32, 32)
        up.append(TensorDataset(np.ascontiguousarray(np.repeat(big, 3, axis=1)), labels))
    return up[0], up[1]


def parse_args(argv=None):
    p = training_parser(__doc__.splitlines()[0], epochs=6, batch_help="samples per rank and step",
                        lr_help="OneCycleLR's max_lr (CosineAnnealingLR's initial lr)",
                        seed_help="seed of the weights and the sampler")
    p.add_argument("--width", type=integer(1, "channels of the first block", 16), default=16,
                   help="channels of the first block (the second has twice as many)")
    p.add_argument("--arch", choices=["small", "resnet18"], default="small",
                   help="small: two residual blocks on 8x8 digits; resnet18: ResNet-18 on 3x32x32 "
                        "(the digits upscaled; --width 64 is the 11.2 M-parameter model)")
    p.add_argument("--data", choices=["digits", "synthetic"], default="digits",
                   help="digits (scikit-learn's, no download) or random CIFAR-shaped images for "
                        "timing (needs --arch resnet18)")
    p.add_argument("--scheduler", choices=["onecycle", "cosine"], default="onecycle",
                   help="OneCycleLR stepped per batch, or CosineAnnealingLR per epoch")
    p.add_argument("--powersgd", type=integer(0, "PowerSGD's matrix_approximation_rank, 0: off",
                                              2), default=0, metavar="RANK",
                   help="compress gradients with PowerSGD at this rank (0: plain all-reduce)")
    p.add_argument("--powersgd-start", type=integer(2, "plain all-reduce steps before PowerSGD",
                                                    20), default=20,
                   help="start_powerSGD_iter: steps of plain all-reduce first")
    add_run_arguments(p, checkpoint_dir="checkpoints-resnet",
                      checkpoint_help="checkpoints and metrics.jsonl of the run",
                      resume_help="continue from <checkpoint-dir>/last.npz")
    args = parse_together(p, argv)
    stop_if_any("--data synthetic makes 3x32x32 images: use it with --arch resnet18"
                if args.data == "synthetic" and args.arch != "resnet18" else None,
                "train_resnet.py", "checking the command line")
    return args


PROG = "train_resnet.py"


def header(args, world, train, test, model):
    places = hosts()
    nodes = sorted({host for host, _ in places})
    params = sum(p.numel() for p in model.parameters())
    hook = (f"PowerSGD rank {args.powersgd} from step {args.powersgd_start}" if args.powersgd
            else "plain all-reduce")
    return (f"hpcgrad ResNet job: {counted(world, 'rank')} on {counted(len(nodes), 'node')}; {args.arch}, width "
            f"{args.width} "
            f"({params:,} parameters); SyncBatchNorm; ZeRO over SGD(momentum {args.momentum}); "
            f"{args.scheduler} lr (max {args.lr}); gradients: {hook}; global batch "
            f"{args.batch_size * world} ({args.batch_size} per rank); epochs {args.epochs}\n"
            f"data: {len(train)} train / {len(test)} test samples; checkpoints and metrics.jsonl "
            f"in {args.checkpoint_dir}\n"
            f"ranks: {rank_places(places)}\n"
            f"arguments: {' '.join(f'{k}={v}' for k, v in sorted(vars(args).items()))}")


# --- PowerSGD's memory in a checkpoint ------------------------------------------------------------
def powersgd_memory(state):
    """This rank's PowerSGD state as JSON-able values (float32 values are exact as JSON floats)."""
    if state is None:
        return None
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    arrays = {kind: {str(k): np.asarray(v).tolist() for k, v in memory.items()}
              for kind, memory in (("error", state.error_dict), ("p", state.p_memory_dict),
                                   ("q", state.q_memory_dict))}
    return {"iter": state.iter, "rng": [name, keys.tolist(), pos, has_gauss, cached],
            "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
            "next_stats_report": state.next_stats_report, **arrays}


def restore_powersgd(state, saved, dtype):
    state.iter = saved["iter"]
    name, keys, pos, has_gauss, cached = saved["rng"]
    state.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    state.total_numel_before_compression, state.total_numel_after_compression = saved["numel"]
    state.next_stats_report = saved["next_stats_report"]
    for kind, memory in (("error", state.error_dict), ("p", state.p_memory_dict),
                         ("q", state.q_memory_dict)):
        memory.clear()
        memory.update({int(k): np.asarray(v, dtype=dtype) for k, v in saved[kind].items()})


def compress(model, args):
    """With --powersgd, DDP's gradients go through PowerSGD: its state; else None."""
    if not args.powersgd:
        return None
    state = PowerSGDState(None, matrix_approximation_rank=args.powersgd,
                          start_powerSGD_iter=args.powersgd_start, random_seed=args.seed)
    model.register_comm_hook(state, powerSGD_hook)
    return state


def schedule(optimizer, args, steps_per_epoch):
    """--scheduler's: OneCycleLR over every step of the run, or CosineAnnealingLR per epoch."""
    if args.scheduler == "onecycle":
        return OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)
    return CosineAnnealingLR(optimizer, T_max=args.epochs)


def restore_buckets(model, bucket_indices):
    """Give a resumed DDP the gradient buckets the saved run had settled on.

    DDP rebuilds its buckets in gradient-ready order after a process's first backward, and
    PowerSGD keeps its error and its warm-start P and Q per bucket, laid out as the bucket is:
    a resumed process starting from the initial buckets would add the saved error to the
    wrong gradients. (PyTorch has the same hazard; it only requires start_powerSGD_iter > 1.)
    """
    if bucket_indices is not None:
        model.reducer.initialize_buckets(bucket_indices)
        model.reducer.has_rebuilt_buckets = True


def resume_problem(meta, path, world, args):
    """Why the checkpoint cannot continue at this world size / with these flags, or None."""
    saved_world = int(meta.get("world_size", world))
    saved = meta.get("args", {})
    if saved_world != world:
        return (f"{path} was saved by {saved_world} ranks; at {world} ranks the shards, the "
                f"steps per epoch that {args.scheduler}'s schedule was laid out for and each "
                f"rank's PowerSGD error differ. Resume with {saved_world} ranks, or start a new "
                "run (another --checkpoint-dir)")
    for flag in ("powersgd", "scheduler", "arch", "data", "width", "batch_size", "epochs"):
        if flag in saved and saved[flag] != getattr(args, flag):
            return (f"{path} was saved with --{flag.replace('_', '-')} {saved[flag]}, this run "
                    f"has {getattr(args, flag)}; resume with the same value, or start a new run")
    return None


class ResNetJob(Job):
    """A residual network: cross-entropy, ZeRO over SGD, OneCycleLR (per step) or
    CosineAnnealingLR (per epoch), PowerSGD's state in the checkpoint."""

    prog = PROG

    def __init__(self, args, model, optimizer, scheduler, hook_state, sampler, train_loader,
                 test_loader):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.hook_state, self.sampler = hook_state, sampler
        self.train_loader, self.test_loader = train_loader, test_loader

    def batches(self, epoch):
        self.sampler.set_epoch(epoch)
        return self.train_loader

    def step(self, batch, step):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.args.scheduler == "onecycle":
            self.scheduler.step()
        return loss.item(), len(labels.array), {"lr": self.scheduler.get_last_lr()[0]}

    def end_epoch(self, epoch):
        if self.args.scheduler == "cosine":
            self.scheduler.step()
        test_loss, accuracy = evaluate(self.model, self.test_loader, F.cross_entropy)
        sent, state = "", self.hook_state
        if state is not None and state.bytes_uncompressed_per_step:
            sent = (f"  sent {state.bytes_per_step:,} of {state.bytes_uncompressed_per_step:,} "
                    "bytes/step")
        return ({"test_loss": test_loss, "test_accuracy": accuracy},
                f"test loss {test_loss:.4f}  test accuracy {accuracy:.4f}  "
                f"lr {self.scheduler.get_last_lr()[0]:.4g}{sent}")

    def checkpoint_state(self):
        self.optimizer.consolidate_state_dict(to=0)  # every rank's momentum shard to rank 0
        memories = [None] * dist.get_world_size()
        dist.all_gather_object(memories, powersgd_memory(self.hook_state))
        reducer = self.model.reducer
        return {"scheduler": self.scheduler.state_dict(),
                "powersgd": memories if self.hook_state is not None else None,
                "buckets": reducer.bucket_indices() if reducer.has_rebuilt_buckets else None}

    def restore(self, meta):
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.hook_state is not None:
            restore_powersgd(self.hook_state, meta["powersgd"][dist.get_rank()], np.float32)
            restore_buckets(self.model, meta["buckets"])


def main(argv=None):
    args = parse_args(argv)
    # The checkpoint is checked before the model is made: another --width would not fit it.
    _, world, checkpoints = start(
        args, PROG, lambda meta, path, world: resume_problem(meta, path, world, args))
    hg.manual_seed(args.seed)
    module = nn.SyncBatchNorm.convert_sync_batchnorm(build_model(args.width, args.arch))
    model = DistributedDataParallel(module)
    hook_state = compress(model, args)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, lr=args.lr,
                                        momentum=args.momentum)
    train, test = datasets(args)
    sampler, train_loader, test_loader = loaders(args, train, test)
    scheduler = schedule(optimizer, args, len(train_loader))
    stop_if_any(check_setup(args, world, train), PROG, "checking the set-up")
    say(header(args, world, train, test, module))
    job = ResNetJob(args, model, optimizer, scheduler, hook_state, sampler, train_loader,
                    test_loader)
    return Loop(job, args, model, optimizer, len(train_loader), checkpoints).run()


if __name__ == "__main__":
    exit_job(main())
