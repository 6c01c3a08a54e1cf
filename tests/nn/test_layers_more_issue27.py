"""Activations, losses, functional helpers and containers of issue 27 beside PyTorch CPU: values
and gradients (kinks and extremes included), every reduction, module defaults, reprs and
state_dict keys, and the errors PyTorch gives for bad arguments."""

import math
import warnings

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as hnn
import hpcgrad.nn.functional as HF

torch = pytest.importorskip("torch")
TF = torch.nn.functional

# random points plus every kink and bound the activations below have, and large magnitudes
POINTS = np.concatenate([np.random.default_rng(0).standard_normal(24) * 3,
                         [0.0, -3.0, 3.0, -1.0, 1.0, 6.0, -2.0, 2.0, 0.5, 25.0, -25.0, 800.0,
                          -800.0]]).reshape(37, 1)


def _np(t):
    return t.detach().numpy()


def _both(arrays, grad=True):
    """The same float arrays as hpcgrad and torch leaves."""
    ours = [hg.tensor(a.copy()).requires_grad_(grad) for a in arrays]
    theirs = [torch.from_numpy(a.copy()).requires_grad_(grad) for a in arrays]
    return ours, theirs


def _compare(ours_fn, theirs_fn, arrays, rtol=1e-10, atol=1e-12, seed=1, inputs_grad=None):
    """Forward values and the gradients of every array (upstream a random tensor) agree."""
    (ours, theirs), outs, grads = _both(arrays), [], []
    for fn, leaves, make in ((ours_fn, ours, hg.tensor), (theirs_fn, theirs, torch.from_numpy)):
        out = fn(*leaves)
        upstream = np.random.default_rng(seed).standard_normal(tuple(out.shape))
        (out * make(upstream)).sum().backward()
        outs.append(_np(out))
        grads.append([None if t.grad is None else _np(t.grad) for t in leaves])
    assert outs[0].shape == outs[1].shape and outs[0].dtype == outs[1].dtype
    np.testing.assert_allclose(outs[0], outs[1], rtol=rtol, atol=atol)
    for i, (g, want) in enumerate(zip(*grads)):
        if inputs_grad is not None and i not in inputs_grad:
            continue
        assert (g is None) == (want is None), i
        if want is not None:
            np.testing.assert_allclose(g, want, rtol=rtol, atol=atol, err_msg=f"gradient {i}")


# --- activations ------------------------------------------------------------------------------
ACTIVATIONS = [  # (functional name, kwargs, module name, module args)
    ("silu", {}, "SiLU", ()), ("leaky_relu", {}, "LeakyReLU", ()),
    ("leaky_relu", {"negative_slope": 0.2}, "LeakyReLU", (0.2,)),
    ("elu", {}, "ELU", ()), ("elu", {"alpha": 0.5}, "ELU", (0.5,)),
    ("celu", {"alpha": 2.0}, "CELU", (2.0,)), ("selu", {}, "SELU", ()),
    ("softplus", {}, "Softplus", ()), ("softplus", {"beta": 2.0, "threshold": 5.0}, "Softplus",
                                       (2.0, 5.0)),
    ("hardtanh", {}, "Hardtanh", ()), ("hardtanh", {"min_val": -2.0, "max_val": 3.0},
                                       "Hardtanh", (-2.0, 3.0)),
    ("relu6", {}, "ReLU6", ()), ("mish", {}, "Mish", ()), ("hardswish", {}, "Hardswish", ()),
    ("hardsigmoid", {}, "Hardsigmoid", ()), ("softsign", {}, "Softsign", ()),
    ("tanhshrink", {}, "Tanhshrink", ()), ("logsigmoid", {}, "LogSigmoid", ()),
    ("threshold", {"threshold": 0.5, "value": -7.0}, "Threshold", (0.5, -7.0)),
    ("glu", {"dim": 0}, "GLU", (0,)),
]
INPLACE = ["silu", "leaky_relu", "elu", "celu", "selu", "hardtanh", "relu6", "mish", "hardswish",
           "hardsigmoid", "threshold"]


@pytest.mark.parametrize("name,kwargs,module,args", ACTIVATIONS,
                         ids=[f"{a[0]}-{i}" for i, a in enumerate(ACTIVATIONS)])
def test_activation_matches_torch(name, kwargs, module, args):
    x = POINTS if name != "glu" else POINTS[1:]  # glu halves: an even axis
    # PyTorch's hardsigmoid backward multiplies by the float 1/6, also for float64
    rtol = 1e-7 if name == "hardsigmoid" else 1e-10
    _compare(lambda t: getattr(HF, name)(t, **kwargs), lambda t: getattr(TF, name)(t, **kwargs),
             [x], rtol=rtol)
    ours, theirs = getattr(hnn, module)(*args), getattr(torch.nn, module)(*args)
    assert repr(ours) == repr(theirs)
    x32 = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    out = ours(hg.tensor(x32))
    assert out.dtype == np.float32
    np.testing.assert_allclose(_np(out), theirs(torch.from_numpy(x32)).numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("name", INPLACE)
def test_inplace_activation_writes_input_and_keeps_gradients(name):
    kwargs = {"threshold": 0.5, "value": -7.0} if name == "threshold" else {}

    def run(fn, t):
        y = t * 1.0  # a non-leaf, as in-place needs under autograd
        out = fn(y, inplace=True, **kwargs)
        assert out is y
        return out * 1.0
    _compare(lambda t: run(getattr(HF, name), t), lambda t: run(getattr(TF, name), t), [POINTS],
             rtol=1e-7 if name == "hardsigmoid" else 1e-10)
    if hasattr(TF, name + "_"):  # the F.elu_ spelling
        x, y = hg.tensor(POINTS.copy()), torch.from_numpy(POINTS.copy())
        getattr(HF, name + "_")(x, **kwargs), getattr(TF, name + "_")(y, **kwargs)
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-12)
    leaf = hg.tensor([1.0, -1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        getattr(HF, name)(leaf, inplace=True, **kwargs)


@pytest.mark.parametrize("shape,count", [((5, 3, 4), 3), ((5, 3), 1), ((7,), 1),
                                         ((2, 4, 3, 3), 4), ((), 1)])
def test_prelu_module_and_functional_match_torch(shape, count):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    if x.size:
        x.reshape(-1)[0] = 0.0
    w = rng.standard_normal(count)
    _compare(HF.prelu, TF.prelu, [x, w])
    ours, theirs = hnn.PReLU(count), torch.nn.PReLU(count, dtype=torch.float64)
    assert repr(ours) == repr(theirs) and list(ours.state_dict()) == ["weight"]
    np.testing.assert_array_equal(_np(ours.weight), np.full(count, 0.25, np.float32))
    ours.load_state_dict({"weight": hg.tensor(theirs.state_dict()["weight"].numpy())})
    np.testing.assert_array_equal(_np(ours(hg.tensor(x))), theirs(torch.from_numpy(x)).detach())
    assert hnn.PReLU(2, init=0.1).weight.array.tolist() == pytest.approx([0.1, 0.1])


def _raises_like(ours, theirs):
    """Both calls raise the same exception type with the same message."""
    with pytest.raises(Exception) as want:
        theirs()
    with pytest.raises(want.type) as got:
        ours()
    assert str(got.value) == str(want.value)


X34 = np.random.default_rng(4).standard_normal((3, 4))
ACTIVATION_ERRORS = [
    ("glu", lambda m, F: F.glu(m.tensor(np.ones((3, 3))), -1)),
    ("glu0d", lambda m, F: F.glu(m.tensor(1.0))),
    ("glu-dim", lambda m, F: F.glu(m.tensor(X34), 2)),
    ("prelu-channels", lambda m, F: F.prelu(m.tensor(X34), m.tensor(np.ones(3)))),
    ("prelu-1d", lambda m, F: F.prelu(m.tensor(np.ones(4)), m.tensor(np.ones(3)))),
    ("prelu-0d", lambda m, F: F.prelu(m.tensor(np.array(1.0)), m.tensor(np.ones(3)))),
    ("prelu-weight2d", lambda m, F: F.prelu(m.tensor(X34), m.tensor(np.ones((2, 2))))),
    ("hardtanh", lambda m, F: F.hardtanh(m.tensor(X34), 1.0, -1.0)),
    ("Hardtanh", lambda m, F: (hnn if m is hg else torch.nn).Hardtanh(1.0, -1.0)),
    ("celu", lambda m, F: F.celu(m.tensor(X34), 0.0)),
]


@pytest.mark.parametrize("call", [c for _, c in ACTIVATION_ERRORS],
                         ids=[i for i, _ in ACTIVATION_ERRORS])
def test_activation_errors_match_torch(call):
    _raises_like(lambda: call(hg, HF), lambda: call(torch, TF))


# --- losses -----------------------------------------------------------------------------------
RNG = np.random.default_rng(5)
PRED, TARGET = RNG.standard_normal((4, 3)), RNG.standard_normal((4, 3))
PROB = RNG.uniform(0.02, 0.98, (4, 3))
PROB[0, :2] = [0.0, 1.0]  # the clamped logs, and the gradient at the ends
LABEL = RNG.uniform(0, 1, (4, 3))
LABEL[0, :2] = [1.0, 0.0]
W43, WROW = RNG.uniform(0.5, 2.0, (4, 3)), RNG.uniform(0.5, 2.0, (3,))
LOGITS = np.concatenate([RNG.standard_normal((3, 3)) * 3, [[60.0, -60.0, 0.0]]])
LOG_P = np.log(RNG.dirichlet(np.ones(3), 4))
PROBS_T = RNG.dirichlet(np.ones(3), 4)
PROBS_T[1, 0] = 0.0  # xlogy's 0 * log 0 = 0
SIGN = np.sign(RNG.standard_normal(4))


def _loss_cases():
    c = []  # (id, functional, [arrays], kwargs, gradient of which arrays to compare)
    c += [("l1", "l1_loss", [PRED, TARGET], {}, None),
          ("l1-weight", "l1_loss", [PRED, TARGET, W43], {}, None),
          ("smooth_l1", "smooth_l1_loss", [PRED, TARGET], {}, None),
          ("smooth_l1-beta", "smooth_l1_loss", [PRED, TARGET], {"beta": 0.3}, None),
          ("smooth_l1-beta0", "smooth_l1_loss", [PRED, TARGET], {"beta": 0.0}, None),
          ("huber", "huber_loss", [PRED, TARGET], {}, None),
          ("huber-delta", "huber_loss", [PRED, TARGET], {"delta": 0.4}, None),
          ("huber-weight", "huber_loss", [PRED, TARGET, W43], {}, None),
          # the target's gradient where it is 0: PyTorch's is NaN (xlogy's), ours finite
          ("kl", "kl_div", [LOG_P, PROBS_T], {}, (0,)),
          ("kl-log_target", "kl_div", [LOG_P, np.log(RNG.dirichlet(np.ones(3), 4))],
           {"log_target": True}, None),
          ("margin", "margin_ranking_loss", [PRED[:, 0], TARGET[:, 0], SIGN], {"margin": 0.2},
           None),
          ("bce", "binary_cross_entropy", [PROB, LABEL], {}, None),
          ("bce-weight", "binary_cross_entropy", [PROB, LABEL, WROW], {}, None),
          ("bcel", "binary_cross_entropy_with_logits", [LOGITS, LABEL], {}, None),
          ("bcel-weight", "binary_cross_entropy_with_logits", [LOGITS, LABEL, W43], {}, None),
          ("bcel-pos_weight", "binary_cross_entropy_with_logits", [LOGITS, LABEL, None, WROW],
           {}, None)]
    return c


LOSS_CASES = [(case, reduction) for case in _loss_cases()
              for reduction in ("none", "mean", "sum")
              + (("batchmean",) if case[1] == "kl_div" else ())]


@pytest.mark.parametrize("case,reduction", LOSS_CASES,
                         ids=[f"{c[0]}-{r}" for c, r in LOSS_CASES])
def test_loss_matches_torch(case, reduction):
    _, name, arrays, kwargs, grads = case
    n_pos = 3 if name == "margin_ranking_loss" else 2
    names = ["weight", "pos_weight"]  # the rest, given as constants (not differentiated)

    def call(F, make):
        extra = {k: make(a.copy()) for k, a in zip(names, arrays[n_pos:]) if a is not None}

        def fn(*args):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # kl_div's 'mean' warning: tested below
                return getattr(F, name)(*args, reduction=reduction, **kwargs, **extra)
        return fn
    _compare(call(HF, hg.tensor), call(TF, torch.from_numpy), arrays[:n_pos], inputs_grad=grads,
             rtol=1e-9)


LOSS_MODULES = [("L1Loss", (), {}), ("SmoothL1Loss", (), {"beta": 0.5}),
                ("HuberLoss", (), {"delta": 2.0}), ("KLDivLoss", (), {"reduction": "batchmean",
                                                                       "log_target": True}),
                ("MarginRankingLoss", (), {"margin": 0.1}), ("BCELoss", (), {}),
                ("BCELoss", (), {"weight": WROW}), ("BCEWithLogitsLoss", (), {}),
                ("BCEWithLogitsLoss", (), {"weight": W43, "pos_weight": WROW})]


@pytest.mark.parametrize("name,args,kwargs", LOSS_MODULES)
def test_loss_module_matches_torch(name, args, kwargs):
    def build(nn, make):
        return getattr(nn, name)(*args, **{k: make(v.copy()) if isinstance(v, np.ndarray) else v
                                           for k, v in kwargs.items()})
    ours, theirs = build(hnn, hg.tensor), build(torch.nn, torch.from_numpy)
    assert repr(ours) == repr(theirs) and ours.reduction == theirs.reduction
    assert list(ours.state_dict()) == list(theirs.state_dict())
    if name == "MarginRankingLoss":
        arrays = [PRED[:, 0], TARGET[:, 0], SIGN]
    elif name.startswith("BCE"):
        arrays = [PROB if name == "BCELoss" else LOGITS, LABEL]
    elif name == "KLDivLoss":
        arrays = [LOG_P, np.log(PROBS_T + 0.1)]
    else:
        arrays = [PRED, TARGET]
    _compare(ours, theirs, arrays)


def test_bce_with_logits_is_stable_in_float32():
    x = np.array([-1000.0, -100.0, -20.0, 0.0, 20.0, 100.0, 1000.0], dtype=np.float32)
    t = np.array([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0], dtype=np.float32)
    pw = np.array([3.0], dtype=np.float32)
    for kwargs in ({}, {"pos_weight": pw}):
        _compare(lambda a, b: HF.binary_cross_entropy_with_logits(
                     a, b, reduction="none", **{k: hg.tensor(v) for k, v in kwargs.items()}),
                 lambda a, b: TF.binary_cross_entropy_with_logits(
                     a, b, reduction="none", **{k: torch.from_numpy(v) for k, v in kwargs.items()}),
                 [x, t], rtol=1e-6, atol=1e-6)
    loss = HF.binary_cross_entropy_with_logits(hg.tensor(x), hg.tensor(t), reduction="none")
    assert np.isfinite(_np(loss)).all() and _np(loss)[0] == 1000.0


def test_hardtanh_deprecated_keywords():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = hnn.Hardtanh(min_value=-2.0, max_value=3.0)
    assert [str(w.message) for w in caught] == [f"keyword argument `{k}_value` is deprecated and "
                                                f"renamed to `{k}_val`" for k in ("min", "max")]
    assert {w.category for w in caught} == {FutureWarning}
    assert (ours.min_val, ours.max_val) == (-2.0, 3.0)


def test_legacy_size_average_and_reduce():
    for size_average, reduce in ((False, None), (None, False), (True, True)):
        with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
            ours = hnn.L1Loss(size_average, reduce)
        with pytest.warns(UserWarning, match="deprecated"):
            got = HF.smooth_l1_loss(hg.tensor(PRED), hg.tensor(TARGET), size_average, reduce)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ours.reduction == torch.nn.L1Loss(size_average, reduce).reduction
            want = TF.smooth_l1_loss(torch.from_numpy(PRED), torch.from_numpy(TARGET),
                                     size_average, reduce)
        np.testing.assert_allclose(_np(got), want.numpy(), rtol=1e-12)


def test_loss_warnings_match_torch():
    def caught(fn):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fn()
        return [str(x.message) for x in w]
    pairs = [(lambda m, F: F.l1_loss(m.tensor(np.ones(3)), m.tensor(np.ones((3, 1))))),
             (lambda m, F: F.huber_loss(m.tensor(np.ones(3)), m.tensor(np.ones((1, 3))))),
             (lambda m, F: F.kl_div(m.tensor(np.ones(3)), m.tensor(np.ones(3)))),
             (lambda m, F: F.kl_div(m.tensor(np.ones(3)), m.tensor(np.ones(3)),
                                    reduction="batchmean"))]
    for call in pairs:
        assert caught(lambda: call(hg, HF)) == caught(lambda: call(torch, TF))


def _t(m, shape, fill=0.5):
    return m.tensor(np.full(shape, fill))


LOSS_ERRORS = [
    ("bce-size", lambda m, F: F.binary_cross_entropy(_t(m, 3), _t(m, (3, 1)))),
    ("bce-input", lambda m, F: F.binary_cross_entropy(_t(m, 3, 1.5), _t(m, 3))),
    ("bce-nan", lambda m, F: F.binary_cross_entropy(_t(m, 3, math.nan), _t(m, 3))),
    ("bce-target", lambda m, F: F.binary_cross_entropy(_t(m, 3), _t(m, 3, -0.5))),
    ("bce-weight", lambda m, F: F.binary_cross_entropy(_t(m, 3), _t(m, 3), weight=_t(m, 2))),
    ("bce-reduction", lambda m, F: F.binary_cross_entropy(_t(m, 3), _t(m, 3), reduction="x")),
    ("bcel-size", lambda m, F: F.binary_cross_entropy_with_logits(_t(m, 3), _t(m, (3, 1)))),
    ("bcel-pos_weight", lambda m, F: F.binary_cross_entropy_with_logits(
        _t(m, (3, 2)), _t(m, (3, 2)), pos_weight=_t(m, 3))),
    ("bcel-weight", lambda m, F: F.binary_cross_entropy_with_logits(
        _t(m, (3, 2)), _t(m, (3, 2)), weight=_t(m, 3))),
    ("l1-broadcast", lambda m, F: F.l1_loss(_t(m, 3), _t(m, 4))),
    ("l1-reduction", lambda m, F: F.l1_loss(_t(m, 3), _t(m, 3), reduction="bad")),
    ("l1-weight", lambda m, F: F.l1_loss(_t(m, 3), _t(m, 3), weight=_t(m, 2))),
    ("l1-weight-reduction", lambda m, F: F.l1_loss(_t(m, 3), _t(m, 3), reduction="bad",
                                                   weight=_t(m, 3))),
    ("smooth-beta", lambda m, F: F.smooth_l1_loss(_t(m, 3), _t(m, 3), beta=-1.0)),
    ("huber-delta", lambda m, F: F.huber_loss(_t(m, 3), _t(m, 3), delta=0.0)),
    ("huber-reduction", lambda m, F: F.huber_loss(_t(m, 3), _t(m, 3), reduction="bad")),
    ("kl-reduction", lambda m, F: F.kl_div(_t(m, 3), _t(m, 3), reduction="bad")),
    ("kl-broadcast", lambda m, F: F.kl_div(_t(m, 3), _t(m, 4), reduction="sum")),
    ("margin-dims", lambda m, F: F.margin_ranking_loss(_t(m, 3), _t(m, (3, 1)), _t(m, 3))),
    ("margin-broadcast", lambda m, F: F.margin_ranking_loss(_t(m, 3), _t(m, 4), _t(m, 3))),
]


@pytest.mark.parametrize("call", [c for _, c in LOSS_ERRORS], ids=[i for i, _ in LOSS_ERRORS])
def test_loss_errors_match_torch(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _raises_like(lambda: call(hg, HF), lambda: call(torch, TF))


# --- functional helpers -----------------------------------------------------------------------
@pytest.mark.parametrize("values,num_classes", [([3, 0, 1], -1), ([[1, 2], [0, 0]], 5),
                                                ([], 3), (2, 4)])
def test_one_hot_matches_torch(values, num_classes):
    ours = HF.one_hot(hg.tensor(np.array(values, dtype=np.int64)), num_classes)
    want = TF.one_hot(torch.tensor(values, dtype=torch.int64), num_classes)
    assert ours.dtype == np.int64 and not ours.requires_grad
    np.testing.assert_array_equal(ours.numpy(), want.numpy())
    assert ours.shape == tuple(want.shape)


@pytest.mark.parametrize("values,dtype,num_classes", [([1.0, 2.0], "float32", -1),
                                                      ([1, 2], "int32", -1),
                                                      ([-1, 2], "int64", -1),
                                                      ([1, 2], "int64", 2), ([1, 2], "int64", -2),
                                                      ([], "int64", -1)])
def test_one_hot_errors_match_torch(values, dtype, num_classes):
    _raises_like(lambda: HF.one_hot(hg.tensor(np.array(values, dtype=dtype)), num_classes),
                 lambda: TF.one_hot(torch.tensor(np.array(values, dtype=dtype)), num_classes))


@pytest.mark.parametrize("p,dim", [(2.0, 1), (1.0, 0), (3.0, -1), (math.inf, 1)])
def test_normalize_matches_torch(p, dim):
    x = np.random.default_rng(6).standard_normal((3, 4))
    x[1] = 0.0  # a zero row: the norm clamps to eps, no NaN in values or gradients
    _compare(lambda t: HF.normalize(t, p, dim), lambda t: TF.normalize(t, p, dim), [x])


@pytest.mark.parametrize("shapes,dim,scale", [(((5, 4), (5, 4)), 1, 1.0),
                                              (((2, 3, 4), (3, 4)), -1, 1.0),
                                              (((3, 1), (1, 4)), 0, 1.0),
                                              (((5, 4), (5, 4)), 1, 1e-9)])
def test_cosine_similarity_matches_torch(shapes, dim, scale):
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(s) * scale for s in shapes]  # 1e-9: norms under eps
    _compare(lambda a, b: HF.cosine_similarity(a, b, dim), lambda a, b: TF.cosine_similarity(
        a, b, dim), arrays, rtol=1e-9)
    ours, theirs = hnn.CosineSimilarity(dim), torch.nn.CosineSimilarity(dim)
    assert repr(ours) == repr(theirs) and (ours.dim, ours.eps) == (theirs.dim, theirs.eps)
    _compare(ours, theirs, arrays, rtol=1e-9)


@pytest.mark.parametrize("p,keepdim,shapes", [(2.0, False, ((5, 4), (5, 4))),
                                              (1.0, True, ((5, 4), (4,))),
                                              (3.0, False, ((4,), (4,)))])
def test_pairwise_distance_matches_torch(p, keepdim, shapes):
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal(s) for s in shapes]
    _compare(lambda a, b: HF.pairwise_distance(a, b, p, keepdim=keepdim),
             lambda a, b: TF.pairwise_distance(a, b, p, keepdim=keepdim), arrays)
    ours, theirs = hnn.PairwiseDistance(p, keepdim=keepdim), torch.nn.PairwiseDistance(
        p, keepdim=keepdim)
    assert repr(ours) == repr(theirs) and (ours.norm, ours.eps, ours.keepdim) == (
        theirs.norm, theirs.eps, theirs.keepdim)
    _compare(ours, theirs, arrays)


HELPER_ERRORS = [
    ("normalize-dim", lambda m, F: F.normalize(m.tensor(X34), dim=2)),
    ("cos-broadcast", lambda m, F: F.cosine_similarity(_t(m, (3, 4)), _t(m, (2, 4)))),
    ("cos-dim", lambda m, F: F.cosine_similarity(_t(m, (3, 4)), _t(m, (3, 4)), dim=2)),
    ("pdist-broadcast", lambda m, F: F.pairwise_distance(_t(m, (3, 4)), _t(m, (2, 4)))),
]


@pytest.mark.parametrize("call", [c for _, c in HELPER_ERRORS], ids=[i for i, _ in HELPER_ERRORS])
def test_helper_errors_match_torch(call):
    _raises_like(lambda: call(hg, HF), lambda: call(torch, TF))


# --- containers -------------------------------------------------------------------------------
def _build(nn, make):
    """The same nesting of containers in either library, seeded so their shapes agree."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"enc": nn.Linear(3, 2), "act": nn.ReLU(),
                                         "dec": nn.Linear(2, 3)})
            self.scales = nn.ParameterList([nn.Parameter(make(np.ones(2))), make(np.zeros(3))])
            self.extra = nn.ParameterDict({"b": make(np.ones((2, 2))), "a": make(np.ones(1))})
            self.extra["c"] = nn.Parameter(make(np.full(4, 2.0)))
    return Net()


def test_container_keys_and_state_dict_load_from_torch():
    ours, theirs = _build(hnn, hg.tensor), _build(torch.nn, torch.from_numpy)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(p.requires_grad for p in ours.parameters())
    ours.load_state_dict({k: hg.tensor(v.numpy()) for k, v in theirs.state_dict().items()})
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        np.testing.assert_array_equal(_np(p), q.detach().numpy(), err_msg=name)
    # reprs agree but for the dtype's name (numpy's float64; torch.float64 / torch.DoubleTensor)
    want = repr(theirs).replace("torch.float64", "float64").replace("torch.DoubleTensor",
                                                                    "float64")
    assert repr(ours) == want


def test_module_dict_operations_match_torch():
    for nn in (hnn, torch.nn):
        d = nn.ModuleDict([("a", nn.ReLU()), ("b", nn.Tanh())])
        d["c"] = nn.Sigmoid()
        d.update({"z": nn.ReLU(), "y": nn.Tanh()})  # a plain dict keeps its order here
        popped = d.pop("b")
        assert isinstance(popped, nn.Tanh) and "b" not in d and len(d) == 4
        assert list(d) == list(d.keys()) == ["a", "c", "z", "y"]
        assert [type(m).__name__ for m in d.values()] == ["ReLU", "Sigmoid", "ReLU", "Tanh"]
        del d["a"]
        d.clear()
        assert len(d) == 0
    for bad in (3, [("a",)], [3]):
        _raises_like(lambda: hnn.ModuleDict(bad), lambda: torch.nn.ModuleDict(bad))


def test_parameter_list_and_dict_operations_match_torch():
    for nn, make in ((hnn, hg.tensor), (torch.nn, torch.from_numpy)):
        pl = nn.ParameterList([make(np.ones(2))])
        pl.append(make(np.zeros(3))).extend([nn.Parameter(make(np.ones(1))), "note"])
        pl += [make(np.ones(5))]
        assert len(pl) == 5 and isinstance(pl[0], nn.Parameter) and pl[3] == "note"
        assert [n for n, _ in pl.named_parameters()] == ["0", "1", "2", "4"]
        assert len(pl[1:3]) == 2 and tuple(pl[-1].shape) == (5,)
        pl[0] = make(np.full(2, 7.0))
        assert isinstance(pl[0], nn.Parameter) and float(pl[0].detach()[0]) == 7.0
        with pytest.raises(IndexError, match="index 5 is out of range"):
            pl[5]
        with pytest.raises(RuntimeError, match="ParameterList should not be called."):
            pl()
        pd = nn.ParameterDict([("w", make(np.ones(2))), ("v", make(np.ones(1)))])
        pd.update({"z": make(np.ones(3)), "a": make(np.ones(3))})  # sorted, as PyTorch's
        assert list(pd) == ["w", "v", "a", "z"] and "a" in pd and pd.get("q", 4) == 4
        assert [n for n, _ in pd.named_parameters()] == ["w", "v", "a", "z"]
        assert pd.popitem()[0] == "z" and tuple(pd.pop("a").shape) == (3,)
        assert tuple(pd.setdefault("s", make(np.ones(6))).shape) == (6,)
        merged = pd | nn.ParameterDict({"m": make(np.ones(1))})
        assert list(merged) == ["w", "v", "s", "m"] and list(pd.copy()) == ["w", "v", "s"]
        assert list(pd.fromkeys(["x", "y"])) == ["x", "y"]
        del pd["w"]
        assert list(pd.keys()) == ["v", "s"]
        pd.clear()
        assert len(pd) == 0
    for bad in (3, [("a",)], [3]):
        _raises_like(lambda: hnn.ParameterDict(bad), lambda: torch.nn.ParameterDict(bad))
    _raises_like(lambda: hnn.ParameterDict()[3], lambda: torch.nn.ParameterDict()[3])
    _raises_like(lambda: hnn.ParameterList(hg.ones(2)), lambda: torch.nn.ParameterList(
        torch.ones(2)))


@pytest.mark.parametrize("dim,sizes,shape", [(1, (2, 3), (4, 6, 5)), (-1, [5, 1], (4, 6, 5)),
                                             (0, (2, -1), (4, 6))])
def test_unflatten_matches_torch(dim, sizes, shape):
    x = np.random.default_rng(9).standard_normal(shape)
    ours, theirs = hnn.Unflatten(dim, sizes), torch.nn.Unflatten(dim, sizes)
    assert repr(ours) == repr(theirs)
    _compare(ours, theirs, [x])


@pytest.mark.parametrize("args,shape", [((1, (2, 2.0)), None), ((1, 4), None),
                                        ((1, (3, 2)), (3, 4)), ((3, (2, 2)), (3, 4))])
def test_unflatten_errors_match_torch(args, shape):
    def call(m, nn):
        module = nn.Unflatten(*args)
        return module(m.tensor(np.ones(shape)))
    _raises_like(lambda: call(hg, hnn), lambda: call(torch, torch.nn))
