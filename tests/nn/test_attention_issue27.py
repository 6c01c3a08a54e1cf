"""scaled_dot_product_attention, MultiheadAttention and the Transformer layers beside PyTorch CPU
with the same weights: forward values, gradients of inputs and parameters, masks, state_dict
keys, initialisation and the errors."""

import math

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.nn import _transformer as T
from hpcgrad.nn._attention import scaled_dot_product_attention as sdpa
from hpcgrad.nn._multihead import MultiheadAttention

torch = pytest.importorskip("torch")
TF = torch.nn.functional
RNG = np.random.default_rng(0)


def _convert(kwargs, make):
    return {k: make(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def _copy_weights(theirs, ours):
    """PyTorch's state_dict into ours: the same keys and shapes, or a failure."""
    sd = {k: hg.tensor(v.detach().numpy().copy()) for k, v in theirs.state_dict().items()}
    assert set(sd) == set(ours.state_dict())
    for k, v in ours.state_dict().items():
        assert tuple(v.shape) == tuple(sd[k].shape), k
    ours.load_state_dict(sd)


def _compare(ours_fn, theirs_fn, arrays, kwargs=None, ours_mod=None, theirs_mod=None, seed=1):
    """Outputs (all Tensors of a tuple), input gradients and parameter gradients agree."""
    kwargs = kwargs or {}
    ours = [hg.tensor(a.copy()).requires_grad_() for a in arrays]
    theirs = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
    out_o = ours_fn(*ours, **_convert(kwargs, hg.tensor))
    out_t = theirs_fn(*theirs, **_convert(kwargs, torch.from_numpy))
    out_o, out_t = (out_o, out_t) if isinstance(out_o, tuple) else ((out_o,), (out_t,))
    for o, t in zip(out_o, out_t):
        assert (o is None) == (t is None)
        if t is not None:
            np.testing.assert_allclose(o.array, t.detach().numpy(), rtol=1e-9, atol=1e-12)
    up = np.random.default_rng(seed).standard_normal(tuple(out_t[0].shape))
    (out_o[0] * hg.tensor(up)).sum().backward()
    (out_t[0] * torch.from_numpy(up)).sum().backward()
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.grad.array, t.grad.numpy(), rtol=1e-9, atol=1e-12)
    if ours_mod is not None:
        named = dict(theirs_mod.named_parameters())
        for name, p in ours_mod.named_parameters():
            np.testing.assert_allclose(p.grad.array, named[name].grad.numpy(), rtol=1e-9,
                                       atol=1e-12, err_msg=name)


# --- scaled_dot_product_attention -------------------------------------------------------------
Q, K, V = (RNG.standard_normal(s) for s in ((2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 7)))
BOOL = RNG.random((4, 6)) > 0.4
BOOL[1] = False  # a query that may attend to nothing: zeros, as PyTorch's math backend
SDPA_CASES = [{}, {"is_causal": True}, {"attn_mask": BOOL}, {"scale": 0.3},
              {"attn_mask": RNG.standard_normal((4, 6))},
              {"attn_mask": np.where(RNG.random((2, 1, 4, 6)) > 0.3, 0.0, -math.inf)}]


@pytest.mark.parametrize("kwargs", SDPA_CASES, ids=lambda k: "-".join(k) or "plain")
def test_sdpa_matches_torch(kwargs):
    _compare(sdpa, TF.scaled_dot_product_attention, [Q, K, V], kwargs)


def test_sdpa_gqa_and_unbatched():
    q, k = RNG.standard_normal((1, 4, 3, 2)), RNG.standard_normal((1, 2, 5, 2))
    _compare(lambda *a: sdpa(*a, enable_gqa=True),
             lambda *a: TF.scaled_dot_product_attention(*a, enable_gqa=True), [q, k, k])
    _compare(sdpa, TF.scaled_dot_product_attention, [Q[0, 0], K[0, 0], V[0, 0]])


def test_sdpa_gradcheck_float64():
    q, k, v = (hg.tensor(a[:1, :1, :3, :2].copy()).requires_grad_() for a in (Q, K, V))
    assert hg.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, is_causal=True), (q, k, v))


def test_sdpa_dropout_statistics():
    hg.manual_seed(0)
    q = hg.zeros(1, 1, 200, 4)  # uniform weights 1/50 over 50 keys; values all ones
    out = sdpa(q, hg.zeros(1, 1, 50, 4), hg.ones(1, 1, 50, 3), dropout_p=0.5)
    assert tuple(out.shape) == (1, 1, 200, 3)
    # each entry: (kept keys) / 50 / (1 - p), mean 1; kept counts vary per query
    assert abs(float(out.array.mean()) - 1.0) < 0.05 and out.array.std() > 0.05
    hg.manual_seed(0)
    again = sdpa(q, hg.zeros(1, 1, 50, 4), hg.ones(1, 1, 50, 3), dropout_p=0.5)
    np.testing.assert_array_equal(out.array, again.array)


def test_sdpa_errors():
    q = hg.tensor(Q)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set"):
        sdpa(q, q, q, attn_mask=hg.tensor(BOOL[:, :4]), is_causal=True)
    with pytest.raises(RuntimeError, match="to have the same dtype.*query.dtype: double "
                                           "key.dtype: float"):
        sdpa(q, q.float(), q)
    with pytest.raises(RuntimeError, match="same embedding size"):
        sdpa(q, hg.tensor(V), hg.tensor(V))
    with pytest.raises(RuntimeError, match="must divide the number of heads"):
        sdpa(q, hg.tensor(K[:, :2]), hg.tensor(V[:, :2]), enable_gqa=True)
    with pytest.raises(ValueError, match="dropout probability"):
        sdpa(q, q, q, dropout_p=1.5)


# --- MultiheadAttention -----------------------------------------------------------------------
def _mha_pair(embed=6, heads=2, **kwargs):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(embed, heads, **kwargs).double()
    ours = MultiheadAttention(embed, heads, **kwargs).double()
    _copy_weights(theirs, ours)
    return ours, theirs


ATTN = RNG.random((3, 4)) > 0.5
ATTN[:, 0] = False
KPM = np.zeros((2, 4), bool)
KPM[1, 3] = True
MHA_CASES = [
    ({}, {}), ({}, {"need_weights": False}),
    ({}, {"attn_mask": ATTN, "key_padding_mask": KPM}),
    ({}, {"attn_mask": ATTN, "key_padding_mask": KPM, "need_weights": False}),
    ({}, {"attn_mask": RNG.standard_normal((4, 3, 4)), "average_attn_weights": False}),
    ({"kdim": 5, "vdim": 3}, {"key_padding_mask": KPM}),
    ({"bias": False, "batch_first": True}, {"attn_mask": ATTN}),
    ({"add_bias_kv": True, "add_zero_attn": True}, {"attn_mask": ATTN, "key_padding_mask": KPM}),
    ({"add_bias_kv": True}, {"need_weights": False, "attn_mask": ATTN}),
]


@pytest.mark.parametrize("ctor,kwargs", MHA_CASES,
                         ids=lambda c: "-".join(c) or "default")
def test_multihead_attention_matches_torch(ctor, kwargs):
    ours, theirs = _mha_pair(**ctor)
    kd, vd = ctor.get("kdim", 6), ctor.get("vdim", 6)
    shape = (lambda n, e: (2, n, e)) if ctor.get("batch_first") else (lambda n, e: (n, 2, e))
    arrays = [RNG.standard_normal(shape(3, 6)), RNG.standard_normal(shape(4, kd)),
              RNG.standard_normal(shape(4, vd))]
    _compare(ours, theirs, arrays, kwargs, ours, theirs)


def test_multihead_attention_unbatched_and_train_mode():
    ours, theirs = _mha_pair(dropout=0.0)
    x = RNG.standard_normal((3, 6))
    _compare(ours, theirs, [x, x, x], {"attn_mask": ATTN[:, :3]}, ours, theirs)
    ours, theirs = _mha_pair(dropout=0.5)
    ours.eval(), theirs.eval()  # dropout off in eval
    _compare(ours, theirs, [x, x, x])


def test_multihead_attention_parameters_and_init():
    m = MultiheadAttention(8, 2)
    names = [n for n, _ in m.named_parameters()]
    assert sorted(names) == ["in_proj_bias", "in_proj_weight", "out_proj.bias",
                             "out_proj.weight"]
    assert m.q_proj_weight is None and m.bias_k is None and m.head_dim == 4
    assert not m.in_proj_bias.array.any() and not m.out_proj.bias.array.any()
    bound = math.sqrt(6 / (8 + 24))  # xavier_uniform_ of (3E, E)
    assert np.abs(m.in_proj_weight.array).max() <= bound
    m = MultiheadAttention(8, 2, kdim=3, vdim=5, add_bias_kv=True)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"q_proj_weight": (8, 8), "k_proj_weight": (8, 3), "v_proj_weight": (8, 5),
                      "in_proj_bias": (24,), "out_proj.weight": (8, 8), "out_proj.bias": (8,),
                      "bias_k": (1, 1, 8), "bias_v": (1, 1, 8)}
    assert m.in_proj_weight is None


def test_multihead_attention_errors():
    with pytest.raises(AssertionError, match="embed_dim must be divisible by num_heads"):
        MultiheadAttention(5, 2)
    with pytest.raises(ValueError, match="must be greater than 0"):
        MultiheadAttention(0, 2)
    m = MultiheadAttention(4, 2)
    x = hg.randn(3, 2, 4)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        m(x, x, x, is_causal=True)
    with pytest.raises(AssertionError, match="was expecting embedding dimension of 4, but got 5"):
        m(hg.randn(3, 2, 5), x, x)
    with pytest.raises(RuntimeError, match="The shape of the 2D attn_mask is"):
        m(x, x, x, attn_mask=hg.zeros(2, 3))
    with pytest.raises(AssertionError, match="expecting key_padding_mask shape of"):
        m(x, x, x, key_padding_mask=hg.zeros(3, 2).bool())


# --- Transformer layers -----------------------------------------------------------------------
E = 8
SRC, TGT = RNG.standard_normal((5, 2, E)), RNG.standard_normal((4, 2, E))
SRC_KPM = np.zeros((2, 5), bool)
SRC_KPM[0, 4] = True
CAUSAL4 = np.triu(np.full((4, 4), -math.inf), 1)


def _pair(make_theirs, make_ours, train):
    torch.manual_seed(0)
    theirs, ours = make_theirs().double(), make_ours().double()
    _copy_weights(theirs, ours)
    theirs.train(train), ours.train(train)
    return ours, theirs


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_train_mode_dropout_zero(norm_first, activation):
    args = (E, 2, 16, 0.0, activation)
    ours, theirs = _pair(lambda: torch.nn.TransformerEncoderLayer(*args, norm_first=norm_first),
                         lambda: T.TransformerEncoderLayer(*args, norm_first=norm_first), True)
    _compare(ours, theirs, [SRC], {"src_key_padding_mask": SRC_KPM}, ours, theirs)


def test_encoder_stack_eval_mode_with_norm_and_causal_mask():
    ours, theirs = _pair(
        lambda: torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(E, 2, 16), 2,
                                            torch.nn.LayerNorm(E), enable_nested_tensor=False),
        lambda: T.TransformerEncoder(T.TransformerEncoderLayer(E, 2, 16), 2, hg.nn.LayerNorm(E)),
        False)
    assert "layers.1.self_attn.in_proj_weight" in ours.state_dict()
    mask = np.triu(np.full((5, 5), -math.inf), 1)
    _compare(ours, theirs, [SRC], {"mask": mask}, ours, theirs)


def test_decoder_stack_batch_first_eval_mode():
    ours, theirs = _pair(
        lambda: torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(
            E, 2, 16, batch_first=True, norm_first=True), 2),
        lambda: T.TransformerDecoder(T.TransformerDecoderLayer(
            E, 2, 16, batch_first=True, norm_first=True), 2), False)
    _compare(ours, theirs, [TGT.transpose(1, 0, 2).copy(), SRC.transpose(1, 0, 2).copy()],
             {"tgt_mask": CAUSAL4, "memory_key_padding_mask": SRC_KPM}, ours, theirs)


def test_transformer_train_mode_dropout_zero():
    ours, theirs = _pair(lambda: torch.nn.Transformer(E, 2, 1, 2, 16, dropout=0.0),
                         lambda: T.Transformer(E, 2, 1, 2, 16, dropout=0.0), True)
    _compare(ours, theirs, [SRC, TGT], {"tgt_mask": CAUSAL4, "src_key_padding_mask": SRC_KPM},
             ours, theirs)


def test_transformer_mask_init_and_errors():
    np.testing.assert_array_equal(T.Transformer.generate_square_subsequent_mask(4).array,
                                  torch.nn.Transformer.generate_square_subsequent_mask(4).numpy())
    m = T.Transformer(E, 2, 1, 1, 16)
    w = m.encoder.layers[0].linear1.weight.array  # xavier_uniform_ of every >1-D parameter
    assert np.abs(w).max() <= math.sqrt(6 / (E + 16)) and np.abs(w).max() > 0.5 * math.sqrt(
        6 / (E + 16))
    assert m.encoder.norm is not None and m.decoder.norm is not None
    with pytest.raises(RuntimeError, match="the batch number of src and tgt must be equal"):
        m(hg.randn(5, 2, E), hg.randn(4, 3, E))
    with pytest.raises(RuntimeError, match="the feature number of src and tgt must be equal"):
        m(hg.randn(5, 2, E + 1), hg.randn(4, 2, E + 1))
    with pytest.raises(RuntimeError, match="activation should be relu/gelu, not tanh"):
        T.TransformerEncoderLayer(E, 2, activation="tanh")
    layer = T.TransformerEncoderLayer(E, 2, 16, activation=hg.nn.GELU())
    assert tuple(layer(hg.randn(3, 2, E)).shape) == (3, 2, E)
