"""The differential fuzzer (tests/fuzz.py) on a fixed budget: each family in every backward mode, and beside PyTorch.

A failure names the family and prints the first failing program as a standalone script. The
sub-cases of known hpcgrad defects against PyTorch (fuzz.KNOWN_DEFECTS) are left out until they
are fixed; a difference between the hpcgrad modes is never left out. More programs:
``python -m tests.fuzz --programs 20000 --seed 1`` (Note [The differential fuzzer]).
"""

import contextlib
import io
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import fuzz  # noqa: E402  (tests/fuzz.py)
import fuzz_families  # noqa: E402

SEED = 25  # the number; any seed must pass
# Programs per family: ~2,000 in all, about 60 s on 2 cores with PyTorch (the multi-output ops
# and custom Functions, where plans went wrong, get more).
BUDGET = {"elementwise": 200, "reduce": 150, "matmul": 150, "shape": 200, "multi": 300,
          "function": 300, "inplace": 200, "hooks": 200, "checkpoint": 120, "nn": 120,
          "attention": 80, "residual": 150}


@pytest.fixture(scope="module")
def fuzzer():
    fz = fuzz.Fuzzer(skip=fuzz.KNOWN_DEFECTS)
    if fz.torch_ns is None:
        yield fz
        return
    torch = fz.torch_ns["T"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only cost
    yield fz
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.timeout(360)  # nn: 34 s alone with numba's cache empty (a float64 1x1 convolution
# at stride 2 compiles the direct kernel, 12 s), beyond 120 with CI's four runs on 2 cores
@pytest.mark.skipif(os.environ.get("HPCGRAD_BACKWARD_PLAN", "off").lower() not in ("off", "0", ""),
                    reason="the fuzzer sets each backward mode itself; the default run covers it")
@pytest.mark.parametrize("family", list(BUDGET))
def test_fuzz_family(fuzzer, family):
    assert set(BUDGET) == set(fuzz_families.FAMILIES)
    failing = []
    for index in range(BUDGET[family]):
        program = fuzzer.program(family, SEED, index)
        found = fuzzer.check(program)
        if found:
            failing.append((index, program, found))
    if not failing:
        return
    modes = [f for f in failing if any(kind == "modes" for _, kind, _ in f[2])]
    index, program, found = (modes or failing)[0]
    program, cut = fuzzer.shrink(program, found)
    lines = [f"program {i} variant {f[0][0]}: {f[0][2]}" for i, _, f in failing[:10]]
    pytest.fail(f"{family}: {len(failing)} of {BUDGET[family]} programs differ "
                f"({len(modes)} between hpcgrad's backward modes):\n  " + "\n  ".join(lines)
                + f"\n\nThe first, as a script (seed {SEED}, program {index}):\n\n"
                + fuzzer.script(program, cut or found), pytrace=False)


@pytest.mark.slow
@pytest.mark.timeout(360)  # ~40 s alone with numba's cache empty; CI runs two suites on 2 cores
def test_fuzz_nn_with_the_direct_convolution_on_every_shape(fuzzer, monkeypatch):
    """The direct convolution (kernels/direct_conv.py, on by default for the shapes it is
    measured faster on) taken for every stride-1, one-group convolution the nn programs draw,
    whatever its channels and row length, and its weight gradient wherever rows are whole
    vectors, strided 1x1 ones through their subsample (Note [Strided 1x1 convolutions]):
    against PyTorch and the backward modes, as above."""
    if fuzzer.torch_ns is None:
        pytest.skip("needs PyTorch: the direct kernel is compared with it here")
    from hpcgrad.base.kernels import direct_conv
    from hpcgrad.nn import _conv
    monkeypatch.setattr(_conv, "_DIRECT_MAX_CHANNELS", 1 << 30)
    monkeypatch.setattr(_conv, "_DIRECT_MAX_CHANNELS_SMALL", 1 << 30)
    monkeypatch.setattr(_conv, "_DIRECT_WHOLE_ROWS", False)
    monkeypatch.setattr(_conv, "_DIRECT_WEIGHT_GRAD_CHANNELS", {512: 1 << 30, 256: 1 << 30})
    monkeypatch.setenv("HPCGRAD_DIRECT_CONV", "1")
    calls, weight_calls = [], []
    kernel, weight_kernel = direct_conv.conv2d_stride1, direct_conv.weight_grad_stride1
    monkeypatch.setattr(direct_conv, "conv2d_stride1",
                        lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    monkeypatch.setattr(direct_conv, "weight_grad_stride1",
                        lambda *args, **kw: weight_calls.append(1) or weight_kernel(*args, **kw))
    subsampled, subsample = [], _conv._subsampled

    def counted(a, geo):
        found = subsample(a, geo)
        if found is not None:
            subsampled.append(1)
        return found
    monkeypatch.setattr(_conv, "_subsampled", counted)
    failing = [(index, found) for index in range(2 * BUDGET["nn"])
               if (found := fuzzer.check(fuzzer.program("nn", SEED + 1, index)))]
    assert calls, "no program took the direct kernel: the test would prove nothing"
    assert weight_calls, "no program took the direct weight gradient: it would go unproven"
    assert subsampled, "no program took a strided 1x1 convolution's subsample: unproven"
    assert not failing, f"{len(failing)} nn programs differ with the direct kernel: {failing[:3]}"


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_fuzz_nn_with_winograd_on_every_shape(fuzzer, monkeypatch):
    """Winograd's tiles (kernels/winograd.py, on by default from 48 channels) taken for every
    3x3 stride-1 one-group convolution the nn programs draw, however few its channels and
    tiles: against
    PyTorch and the backward modes, as above."""
    if fuzzer.torch_ns is None:
        pytest.skip("needs PyTorch: Winograd's tiles are compared with it here")
    from hpcgrad.base.kernels import winograd
    from hpcgrad.nn import _conv
    monkeypatch.setattr(_conv, "_WINOGRAD_CHANNELS", 1)
    monkeypatch.setattr(_conv, "_WINOGRAD_TILES", 1)
    monkeypatch.setenv("HPCGRAD_WINOGRAD", "1")
    calls = []
    kernel = winograd.output_tiles
    monkeypatch.setattr(winograd, "output_tiles", lambda *args: calls.append(1) or kernel(*args))
    failing = [(index, found) for index in range(2 * BUDGET["nn"])
               if (found := fuzzer.check(fuzzer.program("nn", SEED + 2, index)))]
    assert calls, "no program took Winograd's tiles: the test would prove nothing"
    assert not failing, f"{len(failing)} nn programs differ with Winograd's tiles: {failing[:3]}"


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("family", ["matmul", "nn"])
def test_fuzz_with_mkl_for_every_product(fuzzer, monkeypatch, family):
    """base/blas.py (Note [MKL for the products]): the matmul and nn programs with every
    product through MKL, however small (the other tests here take numpy's for products this
    small, MKL or not), against PyTorch and the backward modes, as above."""
    from hpcgrad.base import blas
    if blas._find_mkl() is None:
        pytest.skip("MKL is not installed (pip install -e '.[mkl]')")
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_MKL_FROM", 0)
    calls = []
    gemm, stack, pointers = blas._gemm, blas._gemm_stack, blas._gemm_pointers
    monkeypatch.setattr(blas, "_gemm", lambda *args, **kw: calls.append(1) or gemm(*args, **kw))
    monkeypatch.setattr(blas, "_gemm_stack", lambda *args: calls.append(1) or stack(*args))
    monkeypatch.setattr(blas, "_gemm_pointers", lambda *args: calls.append(1) or pointers(*args))
    failing = [(index, found) for index in range(BUDGET[family])
               if (found := fuzzer.check(fuzzer.program(family, SEED + 2, index)))]
    assert calls, "no product went through MKL: the test would prove nothing"
    assert not failing, f"{len(failing)} {family} programs differ with MKL: {failing[:3]}"


def test_fuzz_compares_values_errors_and_none():
    """The comparison itself: a value, a None gradient, a dtype and whether it raised."""
    a = {"x.grad": np.array([1.0, 2.0]), "y.grad": None}
    assert fuzz._differ(a, dict(a), fuzz.TOLERANCE["modes"]) is None
    assert "x.grad" in fuzz._differ(a, dict(a, **{"x.grad": np.array([1.0, 2.001])}),
                                    fuzz.TOLERANCE["modes"])
    assert "None" in fuzz._differ(a, dict(a, **{"y.grad": np.zeros(2)}), fuzz.TOLERANCE["modes"])
    assert "float32" in fuzz._differ(a, dict(a, **{"x.grad": np.array([1, 2], np.float32)}),
                                     fuzz.TOLERANCE["torch"])
    assert "raised" in fuzz._differ(a, {"error": "RuntimeError: no"}, fuzz.TOLERANCE["torch"])


def test_fuzz_judges_a_float32_difference_in_float64():
    """rounding_only: a cancellation's leftover is rounding; a wrong float32 value, or float64
    twins that disagree, are not. (PyTorch's float32 -0.00049 beside a true 0 below.)"""
    f32 = lambda *v: np.array(v, np.float32)  # noqa: E731
    truth = {"x.grad": np.array([1e-16, 2.0])}
    theirs = {"x.grad": f32(-0.00049, 2.0)}
    assert fuzz.rounding_only({"x.grad": f32(0.0, 2.0)}, theirs, truth, dict(truth))
    assert fuzz.rounding_only({"x.grad": f32(0.0009, 2.0)}, theirs, truth, dict(truth))
    assert not fuzz.rounding_only({"x.grad": f32(0.002, 2.0)}, theirs, truth, dict(truth))
    assert not fuzz.rounding_only({"x.grad": f32(0.0, 2.01)}, theirs, truth, dict(truth))
    assert not fuzz.rounding_only({"x.grad": f32(0.0, 2.0)}, theirs, truth,
                                  {"x.grad": np.array([1e-16, 2.01])})
    twin = fuzz.in_float64(fuzz_families.generate("elementwise", np.random.default_rng(3))[0])
    assert twin["knobs"]["dtype"] == "float64" and "float32" not in fuzz.source(twin)


def test_fuzz_a_float32_cancellation_is_not_reported(fuzzer):
    """Seed 29's program 1056, ``((3 / x1) * x1) ** 3`` in float32: the true gradient is 0 and
    PyTorch's float32 one -0.00049 (two terms of ~80 cancelling); the float64 twins agree."""
    if fuzzer.torch_ns is None:
        pytest.skip("PyTorch is not installed")
    program = fuzzer.program("elementwise", 29, 1056)
    runs = {m: fuzz.run_program(program, fuzzer.ns, m) for m in fuzzer.modes}
    raw = fuzz.compare(program, runs, fuzz.run_program(program, fuzzer.torch_ns))
    before = fuzzer.rounding
    assert fuzzer.check(program) == []
    assert fuzzer.rounding == before + len(raw)  # what the plain comparison found was judged


def test_fuzz_script_reproduces_a_program(fuzzer):
    """The printed script runs on its own and prints every mode's results for each variant."""
    program = fuzzer.program("function", SEED, 0)
    text = fuzzer.script(program, [(0, "torch", "(for the test)")])
    import hpcgrad.autograd as A
    out = io.StringIO()
    previous = A.set_backward_plan("off")  # the script sets each mode in turn
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(text, "<fuzz script>", "exec"), {"__name__": "__main__"})
    finally:
        A.set_backward_plan(previous)
    printed = out.getvalue()
    assert printed.count("--- variant") == len(program)
    for mode in fuzzer.modes:
        assert f"{mode:>9}:" in printed


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("by_heads", [True, False], ids=["by-heads", "grouped"])
def test_fuzz_attention_through_each_causal_path(fuzzer, monkeypatch, by_heads):
    """The attention programs with causal attention's blocks a head at a time (kernels/
    causal_heads.py) or as grouped products (its reference), each seen to run, against
    PyTorch and the backward modes."""
    from hpcgrad.base import blas
    from hpcgrad.nn import _causal_attention
    if not blas.MKL:
        pytest.skip("the blocked causal paths run their products by MKL")
    monkeypatch.setattr(_causal_attention, "_BY_HEADS", by_heads)
    calls = []
    forward = _causal_attention.forward
    monkeypatch.setattr(_causal_attention, "forward", lambda *args: calls.append(
        _causal_attention._plan(*args[:3]) is not None) or forward(*args))
    failing = [(index, found) for index in range(BUDGET["attention"])
               if (found := fuzzer.check(fuzzer.program("attention", SEED + 3, index)))]
    assert by_heads in calls, "no program took the path: the test would prove nothing"
    assert not failing, f"{len(failing)} attention programs differ: {failing[:3]}"
