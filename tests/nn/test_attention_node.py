"""The attention Node (nn/_attention.py Attention, Note [Attention as one Node]) beside the
composition it replaces: the same forward bits, first and second derivatives within rounding,
on shapes, masks (none, causal, boolean with rows that attend to nothing, float) and scales drawn
from the seed; and beside PyTorch."""

import math

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import grad as autograd_grad
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.nn._attention import attention_bias, attention_reference


def _case(seed):
    rng = np.random.default_rng(700 + seed)
    batch = tuple(int(v) for v in rng.integers(1, 4, int(rng.integers(0, 3))))
    length, source, embed = (int(v) for v in rng.integers(1, 7, 3))
    if seed % 4 == 1:
        source = length  # the causal mask's shape
    q = rng.standard_normal(batch + (length, embed))
    k = rng.standard_normal(batch + (source, embed))
    v = rng.standard_normal(batch + (source, int(rng.integers(1, 6))))
    kind = ("none", "causal", "bool", "float")[seed % 4]
    mask = None
    if kind == "bool":
        mask = rng.random((length, source)) < 0.6
        mask[0] = False  # a query that may attend to nothing
    elif kind == "float":
        mask = rng.standard_normal((length, source))
    scale = None if seed % 3 else float(rng.uniform(0.1, 2))
    return rng, q, k, v, mask, kind == "causal", scale


def _both(seed):
    rng, q, k, v, mask, causal, scale = _case(seed)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def node(qt, kt, vt):
        out = F.scaled_dot_product_attention(qt, kt, vt, None if mask is None else hg.tensor(mask),
                                             is_causal=causal, scale=scale)
        assert type(out.grad_fn).__name__ == "AttentionBackward0"
        return out

    def plain(qt, kt, vt):
        bias = attention_bias(None if mask is None else hg.tensor(mask), causal, q.shape[-2],
                              k.shape[-2], qt)
        return attention_reference(qt, kt, vt, bias, 0.0, s)

    return rng, (q, k, v), node, plain


def _derivatives(fn, arrays, u, u2):
    ts = [hg.tensor(a, requires_grad=True) for a in arrays]
    out = fn(*ts)
    firsts = autograd_grad((out * hg.tensor(u)).sum(), ts, create_graph=True)
    total = sum((g * hg.tensor(w)).sum() for g, w in zip(firsts, u2))
    seconds = autograd_grad(total, ts, allow_unused=True)
    return out.array, [g.array for g in firsts], [
        np.zeros(t.shape) if s is None else s.array for s, t in zip(seconds, ts)]


@pytest.mark.parametrize("seed", range(16))
def test_attention_node_matches_the_composition(seed):
    rng, arrays, node, plain = _both(seed)
    ref_out = plain(*[hg.tensor(a) for a in arrays]).array
    u = rng.standard_normal(ref_out.shape)
    u2 = [rng.standard_normal(a.shape) for a in arrays]
    out, firsts, seconds = _derivatives(node, arrays, u, u2)
    want_out, want_firsts, want_seconds = _derivatives(plain, arrays, u, u2)
    np.testing.assert_array_equal(out, want_out)  # the composition's ops in its order
    for got, want in zip(firsts + seconds, want_firsts + want_seconds):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)


def test_attention_node_in_float32_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)).astype(np.float32) for _ in range(3))
    ours = [hg.tensor(a, requires_grad=True) for a in (q, k, v)]
    theirs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*ours, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=True)
    u = rng.standard_normal(out.shape).astype(np.float32)
    (out * hg.tensor(u)).sum().backward()
    (want * torch.from_numpy(u)).sum().backward()
    np.testing.assert_allclose(out.array, want.detach().numpy(), rtol=1e-5, atol=1e-6)
    for h, t in zip(ours, theirs):
        np.testing.assert_allclose(h.grad.array, t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_attention_node_gradcheck():
    rng = np.random.default_rng(10)
    ts = [hg.tensor(rng.standard_normal((2, 3, 4)), requires_grad=True) for _ in range(3)]
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert gradcheck(fn, ts) and gradgradcheck(fn, ts)


def test_heads_as_a_transposed_view_through_mkl_match_numpys_products(monkeypatch):
    """The GPT's layout: q, k, v split from one (b, t, 3*h*d) product and seen as (b, h, t, d),
    batch axes that do not merge; with MKL for every product (base/blas.py ``?gemm_batch`` over
    the heads' addresses, no copy) the output and the gradients equal numpy's products'."""
    from hpcgrad.base import blas
    if blas._find_mkl() is None:
        pytest.skip("MKL is not installed (pip install -e '.[mkl]')")
    rng = np.random.default_rng(11)
    b, t, h, d = 2, 5, 3, 4
    qkv_array = rng.standard_normal((b, t, 3 * h * d))
    u = rng.standard_normal((b, h, t, d))

    def run(mkl):
        monkeypatch.setattr(blas, "MKL", mkl)
        monkeypatch.setattr(blas, "_MKL_FROM", 0)
        qkv = hg.tensor(qkv_array, requires_grad=True)
        q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in qkv.split(h * d, dim=2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out * hg.tensor(u)).sum().backward()
        return out.array, qkv.grad.array

    calls = []
    pointers = blas._gemm_pointers
    monkeypatch.setattr(blas, "_gemm_pointers", lambda *args: calls.append(1) or pointers(*args))
    by_mkl, by_numpy = run(True), run(False)
    assert calls, "no stack went through the pointer path: the test would prove nothing"
    for got, want in zip(by_mkl, by_numpy):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
