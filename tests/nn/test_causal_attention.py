"""Blocked causal attention (nn/_causal_attention.py, Note [Blocked causal attention]) beside the
full Node (HPCGRAD_CAUSAL_BLOCKS=0), the masked composition and PyTorch: values, the three
gradients, second derivatives and gradcheck, on shapes, block sizes, strides and dtypes drawn
from the seed, with more or fewer keys than queries."""

import math

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import grad as autograd_grad
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.base import blas
from hpcgrad.nn import _causal_attention
from hpcgrad.nn._attention import attention_bias, attention_reference

needs_mkl = pytest.mark.skipif(not blas.MKL, reason="the blocked path runs its products by MKL "
                               "(pip install -e '.[mkl]', an Intel CPU)")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few queries from the shortest sequences: every block boundary is hit."""
    monkeypatch.setattr(_causal_attention, "_FROM", 1)
    return monkeypatch


def _case(seed, dtype):
    """(q, k, v, scale) of a drawn shape; half of them views of one (B, L, 3, H, E) array
    with the heads transposed out of it, as a GPT's."""
    rng = np.random.default_rng(900 + seed)
    batch = tuple(int(v) for v in rng.integers(1, 4, int(rng.integers(0, 3))))
    length = int(rng.integers(1, 90))
    source = length if seed % 3 else int(rng.integers(1, 120))  # fewer or more keys too
    embed, embed_v = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    if seed % 2 and source == length and embed == embed_v:
        heads = 3
        packed = rng.standard_normal(batch + (length, 3, heads, embed)).astype(dtype)
        q, k, v = (np.moveaxis(packed[..., i, :, :], -2, -3) for i in range(3))
    else:
        q = rng.standard_normal(batch + (length, embed)).astype(dtype)
        k = rng.standard_normal(batch + (source, embed)).astype(dtype)
        v = rng.standard_normal(batch + (source, embed_v)).astype(dtype)
    scale = None if seed % 4 else float(rng.uniform(0.1, 2))
    return rng, q, k, v, scale


def _run(q, k, v, scale, u, path, monkeypatch):
    """(output, dq, dk, dv) by ``path``: "blocked", "full" (the Node with the bias) or
    "composition"."""
    ts = [hg.tensor(a, requires_grad=True) for a in (q, k, v)]
    if path == "composition":
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        bias = attention_bias(None, True, q.shape[-2], k.shape[-2], ts[0])
        out = attention_reference(*ts, bias, 0.0, s)
    else:
        monkeypatch.setenv("HPCGRAD_CAUSAL_BLOCKS", "1" if path == "blocked" else "0")
        out = F.scaled_dot_product_attention(*ts, is_causal=True, scale=scale)
        assert type(out.grad_fn).__name__ == "AttentionBackward0"
    (out * hg.tensor(u)).sum().backward()
    return [out.array] + [t.grad.array for t in ts]


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(24))
def test_blocked_causal_attention_equals_the_full_node_and_the_composition(
        small_blocks, seed, dtype):
    rng, q, k, v, scale = _case(seed, dtype)
    small_blocks.setattr(_causal_attention, "_BLOCK", int(rng.integers(1, 40)))
    u = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
    got = _run(q, k, v, scale, u, "blocked", small_blocks)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)
    for path in ("full", "composition"):
        want = _run(q, k, v, scale, u, path, small_blocks)
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(a, b, err_msg=f"{name} against the {path} path", **tol)


@needs_mkl
@pytest.mark.parametrize("seed", range(6))
def test_blocked_causal_attention_matches_torch(seed):
    """At the sizes the path takes by itself (64 queries and up, its own block size)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(40 + seed)
    b, h, length, e = int(rng.integers(1, 4)), int(rng.integers(1, 5)), \
        int(rng.integers(64, 200)), int(rng.integers(8, 65))
    q, k, v = (rng.standard_normal((b, h, length, e)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((b, h, length, e)).astype(np.float32)
    ts = [hg.tensor(a, requires_grad=True) for a in (q, k, v)]
    assert _causal_attention.takes(q, k, v)
    out = F.scaled_dot_product_attention(*ts, is_causal=True)
    out.backward(hg.tensor(g))
    tt = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*tt, is_causal=True)
    want.backward(torch.tensor(g))
    np.testing.assert_allclose(out.array, want.detach().numpy(), rtol=1e-4, atol=2e-5)
    for t, w in zip(ts, tt):
        np.testing.assert_allclose(t.grad.array, w.grad.numpy(), rtol=1e-4, atol=1e-4)


@needs_mkl
def test_blocked_causal_attention_gradcheck_and_second_derivatives(small_blocks):
    small_blocks.setattr(_causal_attention, "_BLOCK", 3)
    rng = np.random.default_rng(5)
    for length, source in ((7, 7), (8, 5), (5, 9)):
        q = hg.tensor(rng.standard_normal((2, length, 4)), requires_grad=True)
        k = hg.tensor(rng.standard_normal((2, source, 4)), requires_grad=True)
        v = hg.tensor(rng.standard_normal((2, source, 3)), requires_grad=True)

        def fn(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.7)
        assert _causal_attention.takes(q.array, k.array, v.array)
        assert gradcheck(fn, (q, k, v))
        assert gradgradcheck(fn, (q, k, v))


@needs_mkl
def test_first_and_second_derivatives_under_create_graph_equal_the_composition(small_blocks):
    small_blocks.setattr(_causal_attention, "_BLOCK", 4)
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal((3, 10, 5)) for _ in range(3)]
    u, u2 = rng.standard_normal((3, 10, 5)), [rng.standard_normal((3, 10, 5)) for _ in range(3)]

    def derivatives(path):
        ts = [hg.tensor(a, requires_grad=True) for a in arrays]
        if path == "composition":
            out = attention_reference(*ts, attention_bias(None, True, 10, 10, ts[0]), 0.0,
                                      1 / math.sqrt(5))
        else:
            out = F.scaled_dot_product_attention(*ts, is_causal=True)
        firsts = autograd_grad((out * hg.tensor(u)).sum(), ts, create_graph=True)
        seconds = autograd_grad(sum((g * hg.tensor(w)).sum() for g, w in zip(firsts, u2)), ts)
        return [g.array for g in firsts + seconds]

    for got, want in zip(derivatives("blocked"), derivatives("composition")):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-11)


@needs_mkl
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the full path
def test_a_nan_query_gives_nan_rows_and_a_hidden_inf_value_stays_out_of_earlier_blocks(
        small_blocks):
    """A nan score makes its row nan, as the composition's. An inf in a value reaches no query
    of an earlier block (the full product's 0 * inf made it nan in every row): Note [Blocked
    causal attention]; in its own block it does, as in the full product."""
    small_blocks.setattr(_causal_attention, "_BLOCK", 2)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((6, 3)) for _ in range(3))
    q[2, 1] = np.nan
    v[5, 0] = np.inf  # key 5: in the block of queries 4 and 5
    out = F.scaled_dot_product_attention(hg.tensor(q), hg.tensor(k), hg.tensor(v),
                                         is_causal=True).array
    assert np.isnan(out[2]).all()
    assert np.isfinite(out[[0, 1, 3]]).all()
    assert np.isnan(out[4, 0]) and np.isfinite(out[4, 1:]).all()  # 0 * inf, as the full path
    assert np.isinf(out[5, 0])
    monkeypatch = small_blocks
    monkeypatch.setenv("HPCGRAD_CAUSAL_BLOCKS", "0")
    full = F.scaled_dot_product_attention(hg.tensor(q), hg.tensor(k), hg.tensor(v),
                                          is_causal=True).array
    assert np.isnan(full[:5, 0]).all()  # every row's 0 * inf


def test_what_the_blocked_path_does_not_take(monkeypatch):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 64, 8)).astype(np.float32)
    monkeypatch.setattr(blas, "MKL", True)
    assert _causal_attention.takes(q, q, q)
    assert not _causal_attention.takes(q[:, :63], q[:, :63], q[:, :63])  # under _FROM
    assert not _causal_attention.takes(q, q.astype(np.float64), q)  # dtypes differ
    assert not _causal_attention.takes(q, q[:1], q[:1])  # batch axes differ
    assert not _causal_attention.takes(q.astype(np.float16), q.astype(np.float16),
                                       q.astype(np.float16))
    monkeypatch.setenv("HPCGRAD_CAUSAL_BLOCKS", "0")
    assert not _causal_attention.takes(q, q, q)
    monkeypatch.setenv("HPCGRAD_CAUSAL_BLOCKS", "yes")
    with pytest.raises(ValueError, match="HPCGRAD_CAUSAL_BLOCKS must be '0' or '1'"):
        _causal_attention.takes(q, q, q)
    monkeypatch.delenv("HPCGRAD_CAUSAL_BLOCKS")
    monkeypatch.setattr(blas, "MKL", False)  # numpy's products: the full Node
    assert not _causal_attention.takes(q, q, q)


@needs_mkl
def test_the_heads_joined_back_are_a_view_of_the_output_as_pytorchs():
    """(B, H, L, E) outputs and q, k, v gradients are stored as (B, L, H, E): joining the
    heads, ``y.transpose(1, 2).reshape(B, L, H * E)``, copies nothing."""
    rng = np.random.default_rng(3)
    qkv = hg.tensor(rng.standard_normal((2, 64, 3 * 16)).astype(np.float32), requires_grad=True)
    q, k, v = (z.view(2, 64, 4, 4).transpose(1, 2) for z in qkv.split(16, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    joined = y.transpose(1, 2).reshape(2, 64, 16)
    assert np.shares_memory(joined.array, y.array)
    joined.sum().backward()
    want = _run(*(a.array for a in (q, k, v)), None, np.ones((2, 4, 64, 4), np.float32),
                "composition", None)
    np.testing.assert_allclose(y.array, want[0], rtol=2e-5, atol=2e-6)
    grads = qkv.grad.array.reshape(2, 64, 3, 4, 4).transpose(2, 0, 3, 1, 4)
    for got, w in zip(grads, want[1:]):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)


# --- a head at a time (kernels/causal_heads.py, Note [Causal attention by heads]) -----------

def _heads_case(seed, dtype):
    """4-D (B, H, L, E) q, k, v and the output's gradient g of a drawn shape: half of them
    views of one (B, L, 3, H, E) array as a GPT's, g as the joined heads' gradient (a
    transposed view) or C-contiguous; more or fewer keys than queries."""
    rng = np.random.default_rng(300 + seed)
    b, h = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    length = int(rng.integers(1, 150))
    source = length if seed % 3 else int(rng.integers(1, 150))
    embed, embed_v = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    if seed % 2 and source == length:
        width = max(embed, embed_v)
        packed = rng.standard_normal((b, length, 3, h, width)).astype(dtype)
        q, k, v = (packed[:, :, i, :, :e].transpose(0, 2, 1, 3)
                   for i, e in enumerate((embed, embed, embed_v)))
    else:
        q = rng.standard_normal((b, h, length, embed)).astype(dtype)
        k = rng.standard_normal((b, h, source, embed)).astype(dtype)
        v = rng.standard_normal((b, h, source, embed_v)).astype(dtype)
    g = rng.standard_normal((b, length, h, embed_v)).astype(dtype).transpose(0, 2, 1, 3) \
        if seed % 4 < 2 else rng.standard_normal((b, h, length, embed_v)).astype(dtype)
    return rng, q, k, v, g


def _both(q, k, v, g, scale, needs, by_heads, monkeypatch):
    monkeypatch.setattr(_causal_attention, "_BY_HEADS", by_heads)
    out, probs = _causal_attention.forward(q, k, v, scale)
    return [out, probs] + list(_causal_attention.backward(q, k, v, probs, g, scale, *needs))


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(16))
def test_by_heads_equals_the_grouped_products(small_blocks, seed, dtype):
    """The head-at-a-time loop against the grouped path it replaces (the reference): outputs,
    probabilities and each gradient asked for, at drawn block sizes and strides."""
    rng, q, k, v, g = _heads_case(seed, dtype)
    small_blocks.setattr(_causal_attention, "_BLOCK", int(rng.integers(1, 80)))
    needs = tuple(bool(x) for x in rng.integers(0, 2, 3)) if seed % 5 else (True, True, True)
    scale = float(rng.uniform(0.1, 1.0))
    assert _causal_attention._plan(q, k, v, g) is not None
    got = _both(q, k, v, g, scale, needs, True, small_blocks)
    want = _both(q, k, v, g, scale, needs, False, small_blocks)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)
    names = ("output", "probabilities", "dq", "dk", "dv")
    packed = all(needs) and q.shape == k.shape == v.shape  # the gradients in one array
    for name, a, b in zip(names, got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.strides == b.strides or (packed and name[0] == "d"), name
            np.testing.assert_allclose(a, b, err_msg=name, **tol)
    if packed:
        owner = got[2].base
        assert all(g.base is owner and g.base.shape == (q.shape[0], q.shape[2], 3) + q.shape[1:2]
                   + q.shape[3:] for g in got[2:])


@needs_mkl
def test_by_heads_gradcheck_and_second_derivatives(small_blocks):
    """Through scaled_dot_product_attention on 4-D float64 inputs, blocks of 3 queries."""
    small_blocks.setattr(_causal_attention, "_BLOCK", 3)
    rng = np.random.default_rng(6)
    for length, source in ((7, 7), (8, 5), (5, 9)):
        q = hg.tensor(rng.standard_normal((1, 2, length, 4)), requires_grad=True)
        k = hg.tensor(rng.standard_normal((1, 2, source, 4)), requires_grad=True)
        v = hg.tensor(rng.standard_normal((1, 2, source, 3)), requires_grad=True)

        def fn(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.7)
        assert _causal_attention._plan(q.array, k.array, v.array) is not None
        assert gradcheck(fn, (q, k, v))
        assert gradgradcheck(fn, (q, k, v))


@needs_mkl
def test_what_the_by_heads_loop_does_not_take(monkeypatch):
    """Not 4-D, empty, or switched off: the grouped products (and the same results)."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 3, 64, 8)).astype(np.float32)
    assert _causal_attention._plan(q, q, q) is not None
    assert _causal_attention._plan(q[0], q[0], q[0]) is None
    assert _causal_attention._plan(q[:0], q[:0], q[:0]) is None
    monkeypatch.setattr(_causal_attention, "_BY_HEADS", False)
    assert _causal_attention._plan(q, q, q) is None


@needs_mkl
def test_a_gpts_q_k_v_gradients_are_joined_without_a_copy(monkeypatch):
    """q, k and v split from one (B, L, 3 * H * E) output: their gradients are written side by
    side in one array, so split's backward joins them as a view (tensor/ops/split.py), not
    with a Cat; qkv's gradient equals the composition's."""
    from hpcgrad.tensor.ops import split
    rng = np.random.default_rng(12)
    b, length, h, e = 2, 70, 3, 8
    data = rng.standard_normal((b, length, 3 * h * e)).astype(np.float32)
    u = rng.standard_normal((b, length, h * e)).astype(np.float32)

    def run(attend):
        qkv = hg.tensor(data, requires_grad=True)
        q, k, v = (z.view(b, length, h, e).transpose(1, 2) for z in qkv.split(h * e, dim=2))
        y = attend(q, k, v).transpose(1, 2).reshape(b, length, h * e)
        (y * hg.tensor(u)).sum().backward()
        return qkv.grad.array

    cats, cat = [], split.Cat.apply
    monkeypatch.setattr(split.Cat, "apply", staticmethod(lambda *args: cats.append(1) or
                                                         cat(*args)))
    got = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not cats
    want = run(lambda q, k, v: attention_reference(
        q, k, v, attention_bias(None, True, length, length, q), 0.0, 1 / math.sqrt(e)))
    assert cats  # the composition's gradients are made apart: copied
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
