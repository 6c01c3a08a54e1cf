"""kernels/wide.py: the loops it is given compile 512 bits wide on an AVX-512 host, and LLVM's
own width is back for every loop compiled after (Note [512-bit loops])."""

import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from hpcgrad.base.kernels import cpu, wide

pytestmark = pytest.mark.skipif(not wide.AVX512, reason="the host has no AVX-512 (or "
                                "NUMBA_CPU_NAME is set): compile_wide leaves loops as they are")


def _scale(x, out):
    for k in range(x.size):
        out[k] = x[k] * np.float32(3.0) + np.float32(1.0)


def test_the_given_loop_is_512_bits_wide_and_later_loops_are_not():
    signature = "void(float32[::1], float32[::1])"
    wide_loop, plain_loop = njit(_scale), njit(_scale)
    wide.compile_wide(wide_loop, [signature])
    plain_loop.compile(signature)  # after: LLVM's own width again
    x = np.arange(100, dtype=np.float32)
    got, want = np.empty_like(x), np.empty_like(x)
    wide_loop(x, got)
    plain_loop(x, want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, x * 3 + 1)
    assert "zmm" in next(iter(wide_loop.inspect_asm().values()))
    assert "zmm" not in next(iter(plain_loop.inspect_asm().values()))


def test_the_gelu_backward_loop_is_compiled_wide(tmp_path):
    # in a fresh cache directory, so that the loop is compiled here (a loop numba loads from
    # its cache has no assembly to inspect)
    code = ("from hpcgrad.base.kernels import cpu; f = cpu._gelu_backward_float32; "
            "print(len(f.signatures), 'zmm' in next(iter(f.inspect_asm().values())))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["1", "True"]


def test_a_loop_left_scalar_prints_no_remark_and_other_output_passes(capfd):
    """LLVM's "loop not vectorized" remarks for loops kept scalar on purpose are dropped from
    a cold compile's stderr; anything else printed meanwhile is kept."""
    def running_max(x, out):
        for r in range(x.shape[0]):
            m = x[r, 0]
            for k in range(x.shape[1]):
                v = x[r, k]
                m = v if v > m else m  # a select: not a reduction LLVM vectorizes
            out[r] = m
    loop = njit(error_model="numpy", fastmath={"reassoc"})(running_max)
    with wide._without_vectorizer_remarks():
        print("kept", file=sys.stderr)
        os.write(2, b"remark: <unknown>:0:0: loop not vectorized: planted\n")
    wide.compile_wide(loop, ["void(float32[:, ::1], float32[::1])"], interleave=1)
    err = capfd.readouterr().err
    assert "kept" in err and "remark" not in err
    x = np.random.default_rng(0).standard_normal((3, 20)).astype(np.float32)
    out = np.empty(3, np.float32)
    loop(x, out)
    np.testing.assert_array_equal(out, x.max(1))
