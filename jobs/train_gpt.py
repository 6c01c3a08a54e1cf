"""A small GPT on the Python standard library's own source: bytes in, next byte out, over DDP.

    mpiexec -n 2 python jobs/train_gpt.py                          # train (a minute or two)
    mpiexec -n 2 python jobs/train_gpt.py --zero --checkpoint-activations
    mpiexec -n 2 python jobs/train_gpt.py --resume                 # from checkpoints-gpt/last.npz
    .venv-ft/bin/mpirun --with-ft ulfm --mca btl tcp,self --mca pml ob1 -n 4 \
        python jobs/train_gpt.py --elastic                         # survive lost ranks

The text: the top-level .py files of sysconfig.get_paths()["stdlib"], sorted by name and joined,
cut at --corpus-mb (every machine with Python has it, no download); the last --val-fraction of the
bytes is held out. The model: a GPT-2-style decoder over the 256 byte values (token and position
embeddings, --layers pre-LayerNorm blocks of causal scaled_dot_product_attention and a GELU MLP,
the head tied to the token embedding), trained with AdamW (weight decay on the matrices only),
gradients clipped to --clip, the lr warmed up linearly for --warmup steps then cosine-decayed to
a tenth. --zero shards AdamW's state over the ranks (ZeroRedundancyOptimizer);
--checkpoint-activations recomputes each block in backward instead of keeping its activations.

Step s trains on --batch-size * ranks windows of --block-size + 1 bytes whose offsets are drawn
from a generator seeded by (--seed, s) alone; rank r takes the r-th slice of them. So N ranks of
--batch-size B take the very steps of one rank of N B (up to rounding in the sums), and a resumed
run draws exactly the windows the uninterrupted one would have.

An epoch here is --steps-per-epoch steps. Progress, checkpoints and preemption as
jobs/train_ddp.py: a header with the ranks' hosts and pids, one line per epoch on rank 0 (train
loss, validation loss and next-byte accuracy on --val-windows held-out windows, lr, tokens/s) and a
bar on a terminal, <checkpoint-dir>/metrics.jsonl (``python -m hpcgrad.plot <checkpoint-dir>``
draws it: the validation curves are its "test" ones), an atomic checkpoint every --checkpoint-every
steps and at each epoch's end (the model, AdamW's state, consolidated on rank 0 under --zero, and
the scheduler), and on SIGTERM/SIGUSR1/SIGINT a checkpoint at the next step,
<checkpoint-dir>/PREEMPTED and exit status 128 + the signal's number, so --resume continues exactly
where the job stopped. With --elastic (fault-tolerant MPI, docs/elastic.rst) the job goes on
without ranks that die, from an in-memory commit: each step then draws --batch-size windows per
rank left. At the end rank 0 prints --sample-bytes bytes generated from --prompt.
HPCGRAD_TIMELINE=path records a timeline of every rank.
"""

import hashlib
import math
import os
import sysconfig

import numpy as np
from job_args import (add_elastic_arguments, add_run_arguments, integer, parse_together, real,
                      training_parser)

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.nn.functional as F
from hpcgrad import elastic, nn, optim
from hpcgrad.distributed.optim import ZeroRedundancyOptimizer
from hpcgrad.nn.parallel import DistributedDataParallel
from hpcgrad.nn.utils import clip_grad_norm_
from hpcgrad.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from hpcgrad.base.timeline import TIMELINE
from hpcgrad.training.elastic_loop import ElasticLoop
from hpcgrad.training.loop import (Job, Loop, counted, exit_job, rank_places, say, start,
                                   stop_if_any, unwritable)
from hpcgrad.training.loop import hosts as dist_hosts
from hpcgrad.utils.checkpoint import checkpoint as recompute

PROG = "train_gpt.py"
VOCAB = 256  # bytes


# --- the corpus -----------------------------------------------------------------------------------
def corpus_files():
    """The standard library's top-level .py files, sorted by name (site-packages and the test
    packages are in subdirectories, so they stay out)."""
    root = sysconfig.get_paths()["stdlib"]
    return root, sorted(name for name in os.listdir(root) if name.endswith(".py"))


def read_corpus(megabytes):
    """(uint8 array of at most ``megabytes`` MiB of the files joined, files read, directory)."""
    root, names = corpus_files()
    limit = int(megabytes * 2**20)
    parts, size = [], 0
    for name in names:
        if size >= limit:
            break
        with open(os.path.join(root, name), "rb") as f:
            parts.append(f.read())
        size += len(parts[-1])
    return np.frombuffer(b"".join(parts)[:limit], np.uint8), len(parts), root


def split(corpus, val_fraction):
    """(train, validation): the validation text is the corpus' last ``val_fraction``."""
    cut = len(corpus) - int(len(corpus) * val_fraction)
    return corpus[:cut], corpus[cut:]


def window_starts(seed, step, count, span):
    """The offsets of step ``step``'s ``count`` windows (the global batch), in [0, span): a
    function of (seed, step) only, so neither the number of ranks nor a resume changes them."""
    return np.random.default_rng([seed, step]).integers(0, span, size=count)


def windows(text, starts, block):
    """(inputs, targets): the ``block`` bytes at each start and the ``block`` bytes after them."""
    index = starts[:, None] + np.arange(block + 1)
    chunk = text[index].astype(np.int64)
    return hg.tensor(chunk[:, :-1]), hg.tensor(chunk[:, 1:])


# --- the model ------------------------------------------------------------------------------------
class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)) (GPT-2's pre-norm block)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, the blocks, a final LayerNorm and the tied head: logits
    (batch, time, 256) for byte indices (batch, time)."""

    def __init__(self, d, heads, layers, block, checkpoint_activations=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.checkpoint_activations = checkpoint_activations
        # GPT-2's initialization: the default N(0, 1) embedding, read back through the tied
        # head, starts with logits of standard deviation sqrt(d) (a loss near 80, not ln 256);
        # the projections into the residual stream are scaled down by the depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) \
                    else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(hg.arange(idx.shape[1]))
        for block in self.blocks:
            if self.checkpoint_activations and hg.is_grad_enabled():
                x = recompute(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.ln(x) @ self.tok.weight.T


def param_groups(module, weight_decay):
    """AdamW's two groups: the matrices (and embeddings) decay, biases and LayerNorm do not."""
    named = list(module.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def adamw(module, args):
    """AdamW over ``param_groups``; with --zero its state sharded over the ranks."""
    groups = param_groups(module, args.weight_decay)
    betas = (args.momentum, 0.95)
    if args.zero:
        return ZeroRedundancyOptimizer(groups, optim.AdamW, lr=args.lr, betas=betas)
    return optim.AdamW(groups, lr=args.lr, betas=betas)


def schedule(optimizer, args):
    """Linear warm-up from lr / warmup to lr over --warmup steps, then a cosine to lr / 10 at
    the last step: one scheduler.step() per optimizer step."""
    total = args.epochs * args.steps_per_epoch
    cosine = CosineAnnealingLR(optimizer, T_max=total - args.warmup, eta_min=args.lr / 10)
    if args.warmup == 0:
        return cosine
    warm = LinearLR(optimizer, start_factor=1.0 / args.warmup, total_iters=args.warmup)
    return SequentialLR(optimizer, [warm, cosine], milestones=[args.warmup])


def sample(module, prompt, count, block, temperature, seed):
    """``count`` bytes generated after ``prompt`` (the context cut to the last ``block``): the
    most likely byte at temperature 0, else drawn from softmax(logits / temperature) by a
    generator seeded with ``seed``, so a run's sample is repeatable."""
    rng = np.random.default_rng(seed)
    text = list(prompt)
    module.eval()
    with hg.no_grad():
        for _ in range(count):
            context = hg.tensor(np.array([text[-block:]], np.int64))
            logits = module(context).array[0, -1].astype(np.float64)
            if temperature == 0:
                text.append(int(logits.argmax()))
                continue
            z = logits / temperature
            p = np.exp(z - z.max())
            text.append(int(rng.choice(VOCAB, p=p / p.sum())))
    module.train()
    return bytes(text)


def sample_lines(module, args):
    """What rank 0 prints after a run trained to its end: --sample-bytes from --prompt."""
    text = sample(module, args.prompt.encode("utf-8"), args.sample_bytes, args.block_size,
                  args.temperature, args.seed)
    return (f"\nsample ({args.sample_bytes} bytes after {args.prompt!r}, temperature "
            f"{args.temperature:g}):\n{text.decode('utf-8', errors='replace')}")


def evaluate(module, val, args, rank, world):
    """(mean loss per byte, share of bytes predicted exactly) over the --val-windows windows
    (each on one rank: rank, rank + world, ...), the same non-overlapping ones every time."""
    count = min(args.val_windows, (len(val) - 1) // args.block_size)
    mine = np.arange(rank, count, world) * args.block_size
    sums = np.zeros(3)  # loss sum, bytes, bytes the likeliest prediction got right
    module.eval()
    with hg.no_grad():
        for i in range(0, len(mine), args.batch_size):
            x, y = windows(val, mine[i:i + args.batch_size], args.block_size)
            logits = module(x)
            sums += [F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1),
                                     reduction="sum").item(), y.numel(),
                     (logits.array.argmax(-1) == y.array).sum()]
    module.train()
    dist.all_reduce(sums)
    return sums[0] / max(sums[1], 1), sums[2] / max(sums[1], 1)


# --- the command line -----------------------------------------------------------------------------
def parse_args(argv=None):
    p = training_parser(__doc__.splitlines()[0], epochs=6, batch_help="windows per rank and step",
                        lr_help="AdamW's peak learning rate (after the warm-up)",
                        seed_help="seed of the weights, the windows and the sample")
    p.set_defaults(batch_size=16, lr=3e-3)
    # training_parser's SGD momentum is AdamW's first beta here (the same running mean).
    # (argparse has no public way to re-word another's help.)
    p._option_string_actions["--momentum"].help = "AdamW's beta1 (its gradients' running mean)"
    p.add_argument("--steps-per-epoch", type=integer(1, "steps between evaluations", 50),
                   default=50, help="steps per epoch (an evaluation, a line, a checkpoint)")
    p.add_argument("--d-model", type=integer(1, "the width of the residual stream", 128),
                   default=128, help="embedding width")
    p.add_argument("--heads", type=integer(1, "attention heads", 4), default=4,
                   help="attention heads (they divide --d-model)")
    p.add_argument("--layers", type=integer(1, "transformer blocks", 4), default=4,
                   help="transformer blocks")
    p.add_argument("--block-size", type=integer(1, "bytes of context", 64), default=64,
                   help="context length in bytes")
    p.add_argument("--weight-decay", type=real("AdamW's weight decay", 0.1), default=0.1,
                   help="AdamW's decoupled weight decay (matrices and embeddings only)")
    p.add_argument("--warmup", type=integer(0, "steps of linear warm-up", 30), default=30,
                   help="steps of linear lr warm-up before the cosine decay")
    p.add_argument("--clip", type=real("the largest gradient norm, 0: no clipping", 1.0),
                   default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--zero", action="store_true",
                   help="shard AdamW's state over the ranks (ZeroRedundancyOptimizer)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward (less memory)")
    p.add_argument("--corpus-mb", type=real("MiB of standard-library source to read", 2,
                                            positive=True), default=2.0,
                   help="MiB of the standard library's .py files to train and validate on")
    p.add_argument("--val-fraction", type=real("the held-out share of the corpus", 0.1,
                                               positive=True, below=1), default=0.1,
                   help="the corpus' last share held out for validation")
    p.add_argument("--val-windows", type=integer(1, "validation windows", 128), default=128,
                   help="held-out windows of --block-size bytes each evaluation scores")
    p.add_argument("--sample-bytes", type=integer(0, "bytes to generate at the end", 200),
                   default=200, help="bytes of text rank 0 generates at the end (0: none)")
    p.add_argument("--prompt", default="def ", help="the text the sample continues")
    p.add_argument("--temperature", type=real("the sampling temperature, 0: greedy", 0.8),
                   default=0.8, help="sampling temperature (0: always the likeliest byte)")
    add_run_arguments(p, checkpoint_dir="checkpoints-gpt",
                      checkpoint_help="checkpoints and metrics.jsonl of the run",
                      resume_help="continue from <checkpoint-dir>/last.npz")
    add_elastic_arguments(p)
    args = parse_together(p, argv)
    stop_if_any(flag_problem(args), PROG, "checking the command line")
    return args


def flag_problem(args):
    """What makes these flags unusable together (the same on every rank), or None."""
    if args.d_model % args.heads:
        nearest = args.heads * max(1, round(args.d_model / args.heads))
        return (f"--heads {args.heads} does not divide --d-model {args.d_model}; pass a d-model "
                f"that is a multiple of it (for example {nearest})")
    total = args.epochs * args.steps_per_epoch
    if args.warmup >= total:
        return (f"--warmup {args.warmup} leaves no steps to decay over: the run has {total} "
                f"(--epochs {args.epochs} x --steps-per-epoch {args.steps_per_epoch}); pass "
                f"--warmup {total // 10} or train longer")
    if not args.prompt:
        return "--prompt is empty; pass the text the sample should continue, for example 'def '"
    root, names = corpus_files()
    size = min(int(args.corpus_mb * 2**20),
               sum(os.path.getsize(os.path.join(root, name)) for name in names))
    val = int(size * args.val_fraction)
    for part, n in (("training", size - val), ("validation", val)):
        if n < args.block_size + 2:
            return (f"--block-size {args.block_size} needs windows of {args.block_size + 1} "
                    f"bytes, but the {part} text is {n:,} bytes (--corpus-mb {args.corpus_mb:g}, "
                    f"--val-fraction {args.val_fraction:g}); lower --block-size or raise "
                    f"--corpus-mb / --val-fraction")
    return None


def header(args, world, files, root, train, val, module):
    places = dist_hosts()
    hosts = sorted({host for host, _ in places})
    params = sum(p.numel() for p in module.parameters())
    recomputed = "; activation checkpointing" if args.checkpoint_activations else ""
    return (f"hpcgrad GPT job: {counted(world, 'rank')} on {counted(len(hosts), 'node')}; d {args.d_model}, "
            f"{args.heads} heads, {args.layers} layers, context {args.block_size} bytes "
            f"({params:,} parameters){recomputed}; "
            f"{'ZeRO over ' if args.zero else ''}AdamW(weight decay {args.weight_decay}); lr "
            f"{args.lr} after {args.warmup} warm-up steps, cosine to {args.lr / 10:g}; clip "
            f"{args.clip or 'off'}; global batch {args.batch_size * world} windows "
            f"({args.batch_size} per rank); {args.epochs} epochs of {args.steps_per_epoch} steps\n"
            f"data: {len(train) + len(val):,} bytes of {files} .py files in {root} "
            f"({len(train):,} train / {len(val):,} validation); checkpoints and metrics.jsonl "
            f"in {args.checkpoint_dir}\n"
            f"ranks: {rank_places(places)}\n"
            f"arguments: {' '.join(f'{k}={v}' for k, v in sorted(vars(args).items()))}")


# Flags whose change would make a resumed run another run (its windows, model or schedule).
SAME_ON_RESUME = ("d_model", "heads", "layers", "block_size", "zero", "epochs", "steps_per_epoch",
                  "warmup", "lr", "weight_decay", "momentum", "clip", "seed", "corpus_mb",
                  "val_fraction")


def resume_problem(meta, path, world, args, digest):
    """Why the checkpoint cannot continue this run (its windows, model and schedule), or None.
    Another number of ranks with the same global batch continues it (up to rounding)."""
    saved = meta.get("args", {})
    saved_global = int(meta.get("world_size", world)) * saved.get("batch_size", args.batch_size)
    if saved_global != world * args.batch_size:
        hint = (f"--batch-size {saved_global // world}" if saved_global % world == 0
                else f"{saved_global // args.batch_size} ranks")
        return (f"{path} was trained with a global batch of {saved_global} windows; this run has "
                f"{world * args.batch_size} ({world} ranks x --batch-size {args.batch_size}); "
                f"resume with {hint}, or start a new run (another --checkpoint-dir)")
    for flag in SAME_ON_RESUME:
        if flag in saved and saved[flag] != getattr(args, flag):
            return (f"{path} was saved with --{flag.replace('_', '-')} {saved[flag]}, this run "
                    f"has {getattr(args, flag)}; resume with the same value, or start a new run")
    if meta.get("corpus_sha256") not in (None, digest):
        return (f"{path} was trained on another corpus (another Python's standard library?): "
                f"its sha256 differs; resume with the Python that started the run")
    return None


class BytesGPT(Job):
    """The GPT on the standard library's bytes: windows drawn per step, AdamW, warm-up + cosine."""

    prog = PROG

    def __init__(self, args, model, module, optimizer, scheduler, train, val, digest):
        self.args, self.model, self.module = args, model, module
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train, self.val, self.digest = train, val, digest
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.span = len(train) - args.block_size  # a window and its next byte fit after a start
        self.mine = slice(self.rank * args.batch_size, (self.rank + 1) * args.batch_size)
        self.throughput = ("tokens", args.block_size)

    def batches(self, epoch):
        per = self.args.steps_per_epoch
        return range(epoch * per, (epoch + 1) * per)  # step numbers: the windows' seeds

    def step(self, index, step):
        args = self.args
        starts = window_starts(args.seed, index, self.world * args.batch_size, self.span)
        x, y = windows(self.train, starts[self.mine], args.block_size)
        with TIMELINE.span("forward", "step", step=step):
            loss = F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1))
        self.optimizer.zero_grad()
        with TIMELINE.span("backward", "step", step=step):
            loss.backward()
        # DDP has averaged the gradients: every rank clips by the same global norm.
        norm = clip_grad_norm_(self.module.parameters(), args.clip).item() if args.clip \
            else float("nan")
        lr = self.scheduler.get_last_lr()[0]  # the lr this step uses
        with TIMELINE.span("optimizer step", "step", step=step):
            self.optimizer.step()
        self.scheduler.step()
        return loss.item(), args.batch_size, {"lr": lr, "grad_norm": norm}

    def world_changed(self, state, change):
        """--elastic: the survivors' DDP; each step draws --batch-size windows per rank left."""
        self.model = state.ddp
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mine = slice(self.rank * self.args.batch_size, (self.rank + 1) * self.args.batch_size)

    def end_epoch(self, epoch):
        val_loss, val_accuracy = evaluate(self.module, self.val, self.args, self.rank,
                                          self.world)
        lr = self.scheduler.get_last_lr()[0]
        # The validation loss and accuracy are the plot's "test" curves.
        return ({"test_loss": val_loss, "test_accuracy": val_accuracy, "lr": lr},
                f"val loss {val_loss:.4f}  val accuracy {val_accuracy:.4f}  lr {lr:.3g}")

    def checkpoint_state(self):
        if self.args.zero:
            self.optimizer.consolidate_state_dict(to=0)  # every rank's shard of AdamW's state
        return {"scheduler": self.scheduler.state_dict(), "corpus_sha256": self.digest}

    def restore(self, meta):
        self.scheduler.load_state_dict(meta["scheduler"])


def main(argv=None):
    args = parse_args(argv)
    corpus, files, root = read_corpus(args.corpus_mb)
    digest = hashlib.sha256(corpus.tobytes()).hexdigest()
    train, val = split(corpus, args.val_fraction)
    rank, world, checkpoints = start(
        args, PROG, lambda meta, path, world: resume_problem(meta, path, world, args, digest))
    stop_if_any(unwritable(args.checkpoint_dir), PROG, "checking the set-up")
    hg.manual_seed(args.seed)
    module = GPT(args.d_model, args.heads, args.layers, args.block_size,
                 args.checkpoint_activations)
    optimizer = adamw(module, args)
    scheduler = schedule(optimizer, args)
    if args.elastic:  # Note [Elastic training loop]; the step number draws the data
        state = elastic.State(module, optimizer)
        model = state.ddp
    else:
        model = DistributedDataParallel(module)
    say(header(args, world, files, root, train, val, module))
    job = BytesGPT(args, model, module, optimizer, scheduler, train, val, digest)
    if args.elastic:
        loop = ElasticLoop(job, args, state, checkpoints, min_size=args.min_ranks,
                           commit_every=args.commit_every)
    else:
        loop = Loop(job, args, model, optimizer, args.steps_per_epoch, checkpoints)
    status = loop.run()
    if loop.finished and dist.get_rank() == 0 and args.sample_bytes:
        print(sample_lines(module, args), flush=True)
    return status


if __name__ == "__main__":
    exit_job(main())
