"""Whether this host has 512-bit vectors, and compiling chosen numba loops to use them.

Note [512-bit loops]
~~~~~~~~~~~~~~~~~~~~
On a CPU with AVX-512, LLVM still vectorizes a loop 256 bits wide (its ``prefer-vector-width``
for these CPUs, which keeps clock speeds up in memory-bound code). Arithmetic-bound loops, such
as the float32 GELU and its backward with their inlined erf and exp (Note [Vectorizable float32
math]), run faster 16 lanes wide: on a Cascade Lake Xeon, one thread, 2^20 elements, the
backward took 4.5 ms at 8 lanes and 2.7 ms at 16 (PyTorch's: 2.6 ms). Compiling every loop so
made the ResNet-18 step slower, so ``compile_wide`` asks for 16 lanes (LLVM's
``-force-vector-width``, a process-wide option) only while it compiles the loops it is given,
for the signatures it is given, and puts LLVM's choice back after. Where a loop's lanes are
independent elements (GELU's backward) its results do not depend on the width; where it sums
in lanes (softmax's row sums, compiled with ``reassoc``) the order of the sum's terms changes
with the width, as it already does between an AVX2 and an AVX-512 host: those kernels' tests
hold them to their numpy reference and PyTorch within a tolerance, on every host (softmax: the
(8, 4, 128, 128) scores of attention 1.39 -> 0.84 ms). Numba's on-disk cache keeps the
compiled code per CPU, and the choice depends only on the CPU, so a cached loop is the one this
would compile. Other signatures of the same loops compile lazily at numba's width.
"""

import contextlib
import os
import sys
import tempfile
import threading

import llvmlite.binding as llvm
from numba.core import config as numba_config


def _host_has_avx512():
    """Whether numba compiles for a CPU with AVX-512 (NUMBA_CPU_NAME unset, the host has it)."""
    return numba_config.CPU_NAME is None and "+avx512f" in llvm.get_host_cpu_features().flatten()


AVX512 = _host_has_avx512()


def compile_wide(dispatcher, signatures, lanes=16, interleave=None):
    """Compile numba ``dispatcher`` for ``signatures`` now, its loops vectorized ``lanes`` wide
    where the host has AVX-512 (Note [512-bit loops]); elsewhere leave it to compile lazily.
    ``interleave``: vectors a loop's iteration handles (LLVM's ``-force-vector-interleave``;
    None: LLVM's choice, which at 16 lanes may be 4, so a loop of fewer than 64 elements ran
    all scalar: short rows want 1)."""
    if not AVX512:
        return
    llvm.set_option("", f"-force-vector-width={lanes}")
    if interleave is not None:
        llvm.set_option("", f"-force-vector-interleave={interleave}")
    try:
        # fd 2 is the process's: only the main thread swaps it (pytest's capture swaps it too,
        # there); a kernel module first imported in another thread compiles unfiltered
        quiet = _without_vectorizer_remarks() \
            if threading.current_thread() is threading.main_thread() else contextlib.nullcontext()
        with quiet:
            for signature in signatures:
                dispatcher.compile(signature)
    finally:
        llvm.set_option("", "-force-vector-width=0")  # 0: LLVM's own choice again
        if interleave is not None:
            llvm.set_option("", "-force-vector-interleave=0")


@contextlib.contextmanager
def _without_vectorizer_remarks():
    """Drop LLVM's ``remark: ... loop not vectorized: ...`` lines from what the block prints.

    A forced width makes every loop's vectorizing one that was asked for, so LLVM reports each
    loop it left scalar, to stderr, at a cold compile: the loops kept scalar on purpose
    (softmax's eight running maxima, Note [512-bit loops]) printed two such lines to a
    newcomer's first run. What else the block prints to stderr is written back after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not (line.startswith("remark:") and "loop not vectorized" in line):
                    sys.stderr.write(line)
