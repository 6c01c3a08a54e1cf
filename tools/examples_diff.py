"""Lines each examples/ port changes against its pytorch/examples original in examples/_upstream/.

    python tools/examples_diff.py            # a table: port, lines changed, header lines
    python tools/examples_diff.py --diff     # and the changed lines themselves

A port starts with a header comment (what was replaced, the command that runs it); that block is
not counted. Every other line counts once: a replaced run of lines counts as the longer of its two
sides, a deleted or inserted run as its length (difflib's opcodes on the lines, whitespace kept).
"""

import argparse
import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
UPSTREAM = EXAMPLES / "_upstream"


# Note [CPU runs of GPU examples]
# Several originals are GPU tutorials: they move the model to device 0 (``model.to(gpu_id)``),
# call ``torch.cuda.set_device`` or ``.cuda()``, and fail on a machine without a GPU, under PyTorch
# as under hpcgrad. The ports keep those lines (on a GPU machine they run as written); for a CPU
# machine (the tests, CI) ``cpu_variant`` rewrites just those device lines with the edits below,
# and ``lines changed for a CPU run`` is reported beside the port's own count.
CPU_EDITS = (
    (r"torch\.cuda\.set_device\(.*\)$", "pass  # CPU run: no GPU to select"),
    (r"torch\.accelerator\.set_device_index\(.*\)$", "pass  # CPU run: no GPU to select"),
    (r"world_size = torch\.cuda\.device_count\(\)$", "world_size = 2  # CPU run: 2 processes"),
    (r"\.to\((?:self\.)?(?:gpu_id|local_rank)\)", '.to("cpu")'),
    (r"device_ids=\[[^\]]*\]", "device_ids=None"),
    (r"device = 0  # shorthand for cuda:0", 'device = "cpu"'),
    (r'loc = f"cuda:\{self\.(?:gpu_id|local_rank)\}"', 'loc = "cpu"'),
    (r"self\.states\.cuda\(\)", "self.states.clone()"),  # .cuda() copies; states change in place after
    (r"\.cuda\(\)", '.to("cpu")'),
    (r'"cuda:[01]"', '"cpu"'),
    (r"\.to\((?:self\.)?rank\)", '.to("cpu")'),
    (r"if not verify_min_gpu_count\(min_gpus=_min_gpu_count\):", "if False:  # CPU run: no GPU needed"),
    (r"acc = torch\.accelerator\.current_accelerator\(\)$", 'acc = "cpu"'),
)


# The ports that need a GPU as written (the others run on the CPU unchanged).
GPU_ONLY = (
    "distributed/ddp-tutorial-series/single_gpu.py", "distributed/ddp-tutorial-series/multigpu.py",
    "distributed/ddp-tutorial-series/multigpu_torchrun.py", "distributed/ddp-tutorial-series/multinode.py",
    "distributed/ddp/example.py", "distributed/rpc/ddp_rpc/main.py", "distributed/rpc/pipeline/main.py",
    "distributed/rpc/batch/parameter_server.py", "distributed/rpc/batch/reinforce.py",
)


def cpu_variant(text):
    """(text, lines edited): the port with Note [CPU runs of GPU examples]'s device edits."""
    lines, edited = text.splitlines(keepends=True), 0
    for i, line in enumerate(lines):
        new = line
        for pattern, replacement in CPU_EDITS:
            new = re.sub(pattern, replacement, new.rstrip("\n")) + ("\n" if new.endswith("\n") else "")
        edited += new != line
        lines[i] = new
    return "".join(lines), edited


def torch_twin(text):
    """The port with its imports turned back to PyTorch's (and MPI's backend names to gloo, which
    PyTorch runs on the CPU): what the tests and README run under PyTorch to compare."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith(("import hpcgrad", "from hpcgrad")):
            line = line.replace("import hpcgrad as torch", "import torch").replace("hpcgrad", "torch")
            line = re.sub(r"  # until .*", "", line)
        out.append(line.replace('backend="nccl"', 'backend="gloo"'))
    return "".join(out)


def ported_files():
    """Every original under examples/_upstream/ that has a port at the same relative path."""
    return sorted(p.relative_to(UPSTREAM) for p in UPSTREAM.rglob("*.py")
                  if (EXAMPLES / p.relative_to(UPSTREAM)).exists())


def split_header(lines):
    """(header comment lines, the rest): the port's leading run of '#' lines."""
    n = 0
    while n < len(lines) and lines[n].startswith("#"):
        n += 1
    return lines[:n], lines[n:]


def changed_lines(original, port):
    """(count, [(tag, original lines, port lines)]) for two lists of lines."""
    count, hunks = 0, []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, original, port, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        count += max(i2 - i1, j2 - j1)
        hunks.append((tag, original[i1:i2], port[j1:j2]))
    return count, hunks


def count(relative):
    """(lines changed, header lines, hunks) of the port at ``relative`` (a path under examples/)."""
    original = (UPSTREAM / relative).read_text().splitlines()
    header, body = split_header((EXAMPLES / relative).read_text().splitlines())
    n, hunks = changed_lines(original, body)
    return n, len(header), hunks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diff", action="store_true", help="print the changed lines too")
    args = parser.parse_args(argv)
    for relative in ported_files():
        n, header, hunks = count(relative)
        print(f"{str(relative):60s} {n:3d} lines changed  (+{header} header comment lines)")
        if args.diff:
            for _, before, after in hunks:
                for line in before:
                    print(f"    - {line}")
                for line in after:
                    print(f"    + {line}")


if __name__ == "__main__":
    main()
