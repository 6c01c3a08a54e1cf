"""Views, no-op shape ops, contiguous, indexing and in-place checks beside PyTorch (issue 25).

Each case is one program written once against a small adapter (``L``), run on hpcgrad and on
torch; ``same`` holds the logic: both give the same values and gradients, or both raise with
the same message.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.functional  # noqa: F401  (var_mean: hg.var_mean once hpcgrad/__init__ exports it)

torch = pytest.importorskip("torch")

HG = SimpleNamespace(name="hpcgrad", m=hg, tensor=lambda a, rg=False: hg.tensor(
    np.asarray(a, dtype=np.float64), requires_grad=rg), index=lambda i: hg.tensor(i),
    var_mean=hg.functional.var_mean)
TORCH = SimpleNamespace(name="torch", m=torch, tensor=lambda a, rg=False: torch.tensor(
    np.asarray(a, dtype=np.float64), requires_grad=rg), index=lambda i: torch.tensor(i),
    var_mean=torch.var_mean)


def _numpy(t):
    if t is None:
        return None
    return t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t.data)


def _run(lib, program):
    """(values, leaf gradients) of ``program(L, x)``, or the error it raised."""
    x = lib.tensor(np.arange(1.0, 13.0).reshape(3, 4), True)
    try:
        out = program(lib, x)
    except (RuntimeError, ValueError, IndexError) as error:
        return type(error), str(error)
    outs = out if isinstance(out, tuple) else (out,)
    return [_numpy(o) for o in outs], _numpy(x.grad)


def same(program, error=None):
    """``program(L, x)`` (x: a 3x4 float64 leaf) gives on hpcgrad what it gives on torch; with
    ``error``, both raise an error whose message holds it."""
    got, want = _run(HG, program), _run(TORCH, program)
    if error is not None:
        assert isinstance(want[0], type) and error in want[1], f"torch: {want}"
        assert isinstance(got[0], type) and error in got[1], f"hpcgrad: {got}"
        return
    assert not isinstance(want[0], type), f"torch raised: {want}"
    assert not isinstance(got[0], type), f"hpcgrad raised: {got}"
    for g, w in zip(got[0], want[0]):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    if want[1] is None:
        assert got[1] is None
    else:
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12)


def _hooked(make, shape=(3, 4)):
    """``y = make(h)`` (h: ``x * 1`` of ``shape``) with a hook doubling y's gradient: if y were h
    itself, the hook would double h's whole gradient (the bug: 2.0 where PyTorch gives 1.0, and
    the reverse)."""
    def program(L, x):
        h = (x * 1).reshape(shape) if shape else (x * 1)[0, 0]
        y = make(h)
        y.register_hook(lambda g: g * 2)
        (h.sum() + y.sum()).backward()
        return y, h
    return program


# --- 1. no-op shape ops give a new view, as PyTorch (and return self only where it does) ------

NO_OPS = {
    "t_1d": (lambda h: h.t(), (12,)),
    "t_0d": (lambda h: h.t(), ()),
    "T_1d": (lambda h: h.T, (12,)),
    "squeeze_none": lambda h: h.squeeze(),
    "squeeze_dim": lambda h: h.squeeze(0),
    "expand_same": lambda h: h.expand(3, 4),
    "expand_keep": lambda h: h.expand(-1, -1),
    "expand_lead_1": lambda h: h.expand(1, 3, 4),
    "expand_as": lambda h: h.expand_as(h),
    "reshape_same": lambda h: h.reshape(3, 4),
    "view_same": lambda h: h.view(3, 4),
    "permute_identity": lambda h: h.permute(0, 1),
    "transpose_same": lambda h: h.transpose(1, 1),
    "flatten_same": lambda h: h.flatten(1, 1),  # PyTorch returns the input itself here
    "flatten_1d": (lambda h: h.flatten(), (12,)),
    "narrow_all": lambda h: h.narrow(0, 0, 3),
    "getitem_all": lambda h: h[:],
}


@pytest.mark.parametrize("name", NO_OPS)
def test_no_op_shape_op_gives_what_pytorch_gives(name):
    case = NO_OPS[name]
    same(_hooked(*case) if isinstance(case, tuple) else _hooked(case))


@pytest.mark.parametrize("name", ["t_1d", "squeeze_none", "expand_same", "expand_as"])
def test_no_op_shape_op_is_a_view_sharing_memory_and_version(name):
    make, shape = NO_OPS[name] if name == "t_1d" else (NO_OPS[name], (3, 4))
    x = hg.tensor(np.arange(12.0), requires_grad=True)
    h = (x * 1).reshape(shape)
    y = make(h)
    assert y is not h and y._base is h._base and y.grad_fn is not None
    before = h._version
    y.mul_(2)  # a write through the view reaches the base and bumps the shared version
    assert h._version == before + 1 and y._version == h._version
    np.testing.assert_array_equal(h.detach().numpy(), 2 * np.arange(12.0).reshape(shape))


def test_flatten_of_one_dim_returns_its_input_as_pytorch():
    x = hg.tensor(np.arange(3.0), requires_grad=True)
    t = torch.arange(3.0, requires_grad=True)
    assert t.flatten() is t and t.flatten(0, -1) is t  # the reference's own behaviour
    assert x.flatten() is x and x.flatten(0, -1) is x


# --- 2. contiguous() copies a non-contiguous tensor --------------------------------------------

def _write_through_contiguous(make):
    def program(L, x):
        h = x * 1
        c = make(h).contiguous()
        c.mul_(100)  # must not reach h when contiguous() copied
        (h * h).sum().backward(retain_graph=True)
        (c * c).sum().backward()
        return h, c
    return program


@pytest.mark.parametrize("make", [lambda h: h.t(), lambda h: h[:, ::2], lambda h: h[:1].expand(2, 4),
                                  lambda h: h.permute(1, 0)[1:]],
                         ids=["t", "strided", "expand", "permute_slice"])
def test_contiguous_of_a_non_contiguous_tensor_copies(make):
    same(_write_through_contiguous(make))


@pytest.mark.parametrize("make", [lambda h: h, lambda h: h[1:], lambda h: h[:1].t()],
                         ids=["plain", "rows", "size_1_axis"])
def test_contiguous_of_a_contiguous_tensor_is_itself(make):
    same(_write_through_contiguous(make))
    for lib in (HG, TORCH):
        h = make(lib.tensor(np.arange(12.0).reshape(3, 4)))
        assert h.is_contiguous() and h.contiguous() is h
    c = hg.tensor(np.arange(12.0).reshape(3, 4), requires_grad=True).t()
    assert not c.is_contiguous()
    assert c.contiguous().is_contiguous() and c.contiguous().grad_fn is not None


# --- 3. a 0-d integer tensor index is basic indexing: a view ------------------------------------

ZERO_D = {
    "row": lambda L, h: h[L.index(1)],
    "row_col": lambda L, h: h[L.index(1), 2],
    "both": lambda L, h: h[L.index(1), L.index(2)],
    "col": lambda L, h: h[:, L.index(1)],
    "int32": lambda L, h: h[L.index(np.int32(2))],
    "numpy_int": lambda L, h: h[np.int64(1)],
}


@pytest.mark.parametrize("name", ZERO_D)
def test_zero_d_integer_index_gives_a_view(name):
    def program(L, x):
        h = x * 1
        v = ZERO_D[name](L, h)
        v.mul_(10)  # reaches h through the view
        (h * h).sum().backward()
        return h, v
    same(program)
    h = hg.tensor(np.arange(12.0).reshape(3, 4))
    v = ZERO_D[name](HG, h)
    v.add_(1)
    assert h._version == v._version == 1


def test_zero_d_integer_index_assignment():
    def program(L, x):
        h = x * 1
        h[L.index(1)] = x[0] * 3
        h.sum().backward()
        return h
    same(program)


# --- 4. view refuses what needs a copy; setitem strips leading 1s; overlapping writes ----------

VIEW_OK = {
    "flat": lambda h: h.view(-1),
    "split_axis": lambda h: h.view(3, 2, 2),
    "rows_of_t": lambda h: h.t().view(4, 3),
    "expanded_inner": lambda h: h[:1].expand(3, 4).view(3, 2, 2),
    "column_slice": lambda h: h[:, 1:3].view(3, 2, 1),
    "strided_rows": lambda h: h[:, ::2].view(6),
    "size_1": lambda h: h[:, :1].t().view(3),
}
VIEW_REFUSED = {  # (h, "view" or "reshape")
    "t_flat": lambda h, m: getattr(h.t(), m)(-1),
    "t_merge": lambda h, m: getattr(h.t(), m)(12),
    "column_slice": lambda h, m: getattr(h[:, 1:3], m)(6),
    "expanded": lambda h, m: getattr(h[:1].expand(3, 4), m)(12),
    "permuted_3d": lambda h, m: getattr(h.view(3, 2, 2).permute(1, 0, 2), m)(2, 6),
}


@pytest.mark.parametrize("name", VIEW_OK)
def test_view_where_pytorch_views(name):
    def program(L, x):
        h = x * 1
        v = VIEW_OK[name](h)
        v.register_hook(lambda g: g * 3)
        (v * v).sum().backward()
        return v
    same(program)


@pytest.mark.parametrize("name", VIEW_REFUSED)
def test_view_refused_where_it_would_copy(name):
    same(lambda L, x: VIEW_REFUSED[name](x * 1, "view"), error="view size is not compatible "
         "with input tensor's size and stride (at least one dimension spans across two "
         "contiguous subspaces). Use .reshape(...) instead.")

    def program(L, x):  # reshape copies instead
        r = VIEW_REFUSED[name](x * 1, "reshape")
        (r * r).sum().backward()
        return r
    same(program)


def test_view_of_a_wrong_size_keeps_its_message():
    same(lambda L, x: x.view(5, -1), error="is invalid for input of size 12")


SETITEM = {  # (index, value shape): the value has leading size-1 axes beyond the target's
    "row": (1, (1, 4)),
    "row_many_ones": (1, (1, 1, 4)),
    "row_broadcast": (1, (1, 1)),
    "rows_slice": (slice(1, 3), (1, 1, 4)),
    "element": ((1, 2), (1, 1)),
    "advanced": ([0, 2], (1, 1, 4)),
    "advanced_pair": (([0, 2], 1), (1, 2)),
}


@pytest.mark.parametrize("name", SETITEM)
def test_setitem_drops_the_values_leading_size_1_axes(name):
    index, shape = SETITEM[name]

    def program(L, x):
        v = L.tensor(np.arange(2.0, 2.0 + np.prod(shape)).reshape(shape), True)
        h = x * 1
        h[index] = v * 3
        (h * h).sum().backward()
        return h, v.grad
    same(program)


OVERLAP_REFUSED = {
    "unsqueezed_iadd": lambda y: y[None].__iadd__(y),
    "add_t": lambda y: y.view(4, 3)[:3].add_(y.view(4, 3)[:3].t()),  # a square y and y.t()
    "add_row": lambda y: y.add_(y[0]),
    "shifted_rows": lambda y: y[:2].add_(y[1:3]),
    "shifted_alpha": lambda y: y[:2].add_(y[1:3], alpha=2),
    "sub_t": lambda y: y.view(4, 3)[:3].sub_(y.view(4, 3)[:3].t()),
    "mul_first": lambda y: y.mul_(y[0, 0]),
    "div_flat": lambda y: y.view(12)[:8].div_(y.view(12)[4:]),
    "pow_t": lambda y: y.view(4, 3)[:3].pow_(y.view(4, 3)[:3].t()),
    "copy_t": lambda y: y.view(4, 3)[:3].copy_(y.view(4, 3)[:3].t()),
    "copy_shifted": lambda y: y[1:].copy_(y[:-1]),
    "copy_row": lambda y: y.copy_(y[0]),
    "setitem_shifted": lambda y: y.__setitem__(slice(1, 3), y[0:2]),
    "setitem_list": lambda y: y.__setitem__([0, 1], y[1:3]),
    "setitem_list_same": lambda y: y.__setitem__([0, 1], y[:2]),
    "setitem_list_0d": lambda y: y.__setitem__([0, 1], y[0, 1]),
    "setitem_mask_row": lambda y: y.__setitem__(y[:, 0] > 3, y[0]),
}
OVERLAP_ALLOWED = {
    "iadd_self": lambda y: y.__iadd__(y),
    "add_same_view": lambda y: y.add_(y.view(3, 4)),
    "add_detached": lambda y: y.add_(y.detach()),
    "unsqueezed_both": lambda y: y[None].add_(y[None]),
    "disjoint_rows": lambda y: y[:1].add_(y[1:2]),
    "strided_columns": lambda y: y[:, ::2].add_(y[:, 1::2]),  # not dense: PyTorch does not tell
    "shifted_columns": lambda y: y[:, :2].add_(y[:, 1:3]),
    "copy_self": lambda y: y.copy_(y),
    "fill_0d": lambda y: y.fill_(y[0, 1]),
    "masked_fill_0d": lambda y: y.masked_fill_(y > 3, y[0, 1]),
    "setitem_row": lambda y: y.__setitem__(0, y[1]),
    "setitem_all": lambda y: y.__setitem__(slice(None), y),
    "setitem_0d": lambda y: y.__setitem__(0, y[0, 1]),
    "setitem_broadcast": lambda y: y.__setitem__(slice(0, 2), y[0]),
    "setitem_leading_1": lambda y: y.__setitem__(0, y[0:1]),
    "setitem_mask_0d": lambda y: y.__setitem__(y > 3, y[0, 1]),
    "empty": lambda y: y[:0].add_(y[:0]),
}


@pytest.mark.parametrize("name", OVERLAP_REFUSED)
def test_inplace_with_partly_overlapping_operand_is_refused(name):
    def program(L, x):
        y = x * 1
        OVERLAP_REFUSED[name](y)
    same(program, error="unsupported operation: some elements of the input tensor and the "
         "written-to tensor refer to a single memory location. Please clone() the tensor before "
         "performing the operation.")


@pytest.mark.parametrize("name", OVERLAP_ALLOWED)
def test_inplace_with_the_same_or_disjoint_operand_is_allowed(name):
    def program(L, x):
        y = x * 1
        OVERLAP_ALLOWED[name](y)
        (y * y).sum().backward()
        return y
    same(program)


# --- 5. a view taken before its leaf base required grad may not be written with grad on -------

LATE_LEAF = {
    "slice_add": lambda v, L: v.add_(1),
    "setitem": lambda v, L: v.__setitem__(0, 5.0),
    "mul_tensor": lambda v, L: v.mul_(L.tensor([2.0, 3.0, 4.0, 5.0])),
    "zero": lambda v, L: v.zero_(),
    "copy": lambda v, L: v.copy_(L.tensor([2.0, 3.0, 4.0, 5.0])),
}


@pytest.mark.parametrize("name", LATE_LEAF)
def test_view_of_a_leaf_that_later_requires_grad_is_refused(name):
    def program(L, x):
        leaf = L.tensor(np.zeros((3, 4)))
        v = leaf[1]
        leaf.requires_grad_()
        LATE_LEAF[name](v, L)
    same(program, error="a view of a leaf Variable that requires grad is being used in an "
         "in-place operation.")


@pytest.mark.parametrize("name", LATE_LEAF)
def test_view_of_a_leaf_that_later_requires_grad_is_written_under_no_grad(name):
    def program(L, x):
        leaf = L.tensor(np.zeros((3, 4)))
        v = leaf[1]
        leaf.requires_grad_()
        with L.m.no_grad():
            LATE_LEAF[name](v, L)
        (leaf * x).sum().backward()
        return leaf.detach(), v.detach()
    same(program)



# --- 6. an output of split/chunk/unbind used after its memory was written in place ------------

PIECES = {
    "split": (lambda h: h.split(2), 0, "Split"),
    "split_sizes": (lambda h: h.split([1, 2]), 1, "SplitWithSizes"),
    "chunk": (lambda h: h.chunk(3), 2, "Split"),
    "unbind": (lambda h: h.unbind(), 1, "Unbind"),
    "unbind_dim1": (lambda h: h.unbind(1), 3, "Unbind"),
}
WRITES = {
    "base_grad": lambda h, pieces, L: h.mul_(2),
    "base_region": lambda h, pieces, L: h[2:].mul_(2),
    "base_no_grad": lambda h, pieces, L: _no_grad(L, lambda: h.add_(1)),
    "other_piece_no_grad": lambda h, pieces, L: _no_grad(L, lambda: pieces[0].add_(1)),
}


def _no_grad(L, fn):
    with L.m.no_grad():
        fn()


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("name", PIECES)
def test_piece_used_after_its_base_was_written_is_refused(name, write):
    make, k, op = PIECES[name]

    def program(L, x):
        h = x * 1
        pieces = make(h)
        WRITES[write](h, pieces, L)
        (pieces[k] * 2).sum().backward()
    same(program, error=f"Output {k} of {op} is a view and its base or another view of its base "
         "has been modified inplace. This view is the output of a function that returns "
         "multiple views. Such functions do not allow the output views to be modified inplace. "
         "You should replace the inplace operation by an out-of-place one.")


@pytest.mark.parametrize("name", PIECES)
def test_piece_used_before_its_base_was_written(name):
    make, k, _ = PIECES[name]

    def program(L, x):
        h = x * 1
        pieces = make(h)
        z = pieces[k].exp().sum()  # exp saves its result, not the piece
        h.mul_(2)
        z.backward()
        return pieces[k].detach(), h
    same(program)


@pytest.mark.parametrize("name", PIECES)
def test_piece_saved_before_its_base_was_written_fails_at_backward(name):
    make, k, _ = PIECES[name]
    x = hg.tensor(np.arange(1.0, 13.0).reshape(3, 4), requires_grad=True)
    h = x * 1
    pieces = make(h)
    z = (pieces[k] * pieces[k]).sum()
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    t = torch.arange(1.0, 13.0, dtype=torch.float64).reshape(3, 4).requires_grad_()
    th = t * 1
    tp = make(th)
    tz = (tp[k] * tp[k]).sum()
    th.mul_(2)
    with pytest.raises(RuntimeError, match="modified inplace"):  # PyTorch's message for a view
        tz.backward()


def test_unbind_of_one_dim_gives_views():
    h = hg.tensor(np.arange(3.0))
    pieces = h.unbind()
    pieces[1].add_(5)  # no graph: allowed, and reaches h
    np.testing.assert_array_equal(h.numpy(), [0.0, 6.0, 2.0])
    assert pieces[0]._version == h._version == 1


# --- 7. detach_, var_mean, t_ and transpose_ ---------------------------------------------------

def test_detach_in_place():
    def program(L, x):
        h = x * 2
        h.retain_grad()
        out = h * 3
        h.detach_()
        assert not h.requires_grad and h.grad_fn is None and h.is_leaf and h.retains_grad
        (out.sum() + (h * x).sum()).backward()  # h is a constant now; out's graph stays
        return h, out.detach()
    same(program)


def test_detach_in_place_of_a_view_is_refused():
    same(lambda L, x: (x * 2)[1:].detach_(), error="Can't detach views in-place. Use detach() "
         "instead. If you are using DistributedDataParallel (DDP) for training, and "
         "gradient_as_bucket_view is set as True, gradients are views of DDP buckets, and hence "
         "detach_() cannot be called on these gradients.")


VAR_MEAN = {
    "all": lambda L, h: L.var_mean(h),
    "dim": lambda L, h: L.var_mean(h, 1),
    "dims_keepdim": lambda L, h: L.var_mean(h.reshape(3, 2, 2), (0, 2), keepdim=True),
    "correction_0": lambda L, h: L.var_mean(h, 0, correction=0),
    "correction_2": lambda L, h: L.var_mean(h, 1, correction=2),
    "unbiased_false": lambda L, h: L.var_mean(h, False),
    "dim_unbiased": lambda L, h: L.var_mean(h, 1, False, True),
    "one_row": lambda L, h: L.var_mean(h[:1], 0),  # dof 0: inf and nan, as PyTorch
}


@pytest.mark.parametrize("use", ["both", "var", "mean"])
@pytest.mark.parametrize("name", VAR_MEAN)
def test_var_mean(name, use):
    def program(L, x):
        var, mean = VAR_MEAN[name](L, x * 1)
        w = L.tensor(np.arange(1.0, 1.0 + var.numel()).reshape(tuple(var.shape)))
        loss = {"both": (var * w).sum() + (mean * mean).sum(), "var": (var * w).sum(),
                "mean": (mean * w).sum()}[use]
        loss.backward()
        return var, mean
    same(program)


def test_var_mean_refuses_unbiased_with_correction():
    with pytest.raises(RuntimeError, match='Only one of "unbiased" or "correction"'):
        hg.functional.var_mean(hg.tensor(np.ones(3)), 0, True, correction=1)


INPLACE_VIEW = {
    "t_": lambda y: y.t_(),
    "t_1d": lambda y: y[0].t_(),
    "transpose_": lambda y: y.transpose_(0, 1),
    "transpose_neg": lambda y: y.reshape(3, 2, 2).transpose_(-1, 0),
    "transpose_same": lambda y: y.transpose_(1, 1),
}


@pytest.mark.parametrize("name", INPLACE_VIEW)
def test_in_place_view_op(name):
    def program(L, x):
        y = x * 1
        z = INPLACE_VIEW[name](y)
        w = L.tensor(np.arange(z.numel()).reshape(tuple(z.shape)))
        assert z.is_contiguous() == (name in ("t_1d", "transpose_same"))
        (z * z * w).sum().backward()
        return z, L.tensor(list(z.shape)), L.tensor([z._version])
    same(program)
    y = hg.tensor(np.ones((3, 4)), requires_grad=True) * 1
    z = INPLACE_VIEW[name](y)
    assert z.grad_fn.name() == ("TBackward1" if name.startswith("t_") else "TransposeBackward1")


def test_in_place_view_op_on_a_leaf_is_refused():
    same(lambda L, x: x.t_(), error="a leaf Variable that requires grad is being used in an "
         "in-place operation.")
    same(lambda L, x: x.transpose_(0, 1), error="a leaf Variable that requires grad is being "
         "used in an in-place operation.")


def test_in_place_view_op_checks_dims():
    same(lambda L, x: x.detach().reshape(3, 2, 2).t_(), error="t_() expects a tensor with <= 2 "
         "dimensions, but self is 3D")
    same(lambda L, x: x.detach().transpose_(0, 2), error="Dimension out of range")


def test_in_place_view_op_and_views():
    """A view transposed in place; a base transposed while it has views, then written."""
    def program(L, x):
        y = x * 1
        v = y[1:]
        v.t_()  # (4, 2)
        u = y[0]
        y.t_()  # (4, 3): u was made from the (3, 4) y
        y.mul_(L.tensor(np.arange(12.0).reshape(4, 3)))  # u and v see the write
        w = L.tensor(np.arange(8.0).reshape(4, 2))
        ((v * w).sum() + (u * u).sum() + y.sum()).backward()
        return y, u, v
    same(program)


def test_in_place_view_op_bumps_the_version_a_saved_tensor_sees():
    def program(L, x):
        y = x * 1
        z = (y * y).sum()
        y.t_()
        z.backward()
    same(program, error="modified by an inplace operation")


@pytest.mark.parametrize("dims", [(0,), (1,), (0, 1), (-1,), ()])
def test_flip_is_a_copy(dims):
    """torch.flip (what a negative slice step does in numpy, which PyTorch's indexing refuses)."""
    def program(L, x):
        h = x * 1
        f = h.flip(dims)
        f.mul_(10)  # a copy: h stays
        (f * L.tensor(np.arange(12.0).reshape(3, 4)) + h).sum().backward()
        return f, h
    same(program)
