"""MultiheadAttention: PyTorch's parameters, masks and both paths (with and without weights)."""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor.ops.shape import cat
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import functional as F
from hpcgrad.nn import init
from hpcgrad.nn._attention import scaled_dot_product_attention
from hpcgrad.nn._factory import parameter
from hpcgrad.nn.linear import Linear
from hpcgrad.nn.module import Module


class NonDynamicallyQuantizableLinear(Linear):
    """PyTorch's name for MultiheadAttention's out_proj (a plain Linear here)."""


def _const(array):
    return Tensor._make(array, False, None, 0)


def _float_mask(mask, name, like):
    """PyTorch's _canonical_mask: a boolean mask (True = masked out) as a float one of
    ``like``'s dtype with -inf where it holds; a float mask as it is."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        mask = _const(backend.get_array_module(like.array).asarray(mask))
    if mask.dtype == np.bool_:
        xp = backend.get_array_module(mask.array)
        return _const(xp.where(mask.array, -math.inf, 0.0).astype(like.dtype))
    if mask.dtype.kind != "f":
        raise AssertionError(f"only bool and floating types of {name} are supported, got "
                             f"{mask.dtype}")
    return mask


class MultiheadAttention(Module):
    """Attention of ``num_heads`` heads over (L, N, E) queries and (S, N, kdim/vdim) keys and
    values ((N, L, E) with ``batch_first``; (L, E) unbatched), as PyTorch's.

    Parameters as PyTorch's (a state_dict loads): ``in_proj_weight`` (3E, E) when
    kdim == vdim == E, else ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``;
    ``in_proj_bias`` (3E,), ``out_proj`` a Linear(E, E), ``bias_k``/``bias_v`` (1, 1, E) with
    ``add_bias_kv``. Init: xavier_uniform_ projections, zero biases, xavier_normal_ bias_k/v.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got "
                             f"embed_dim={embed_dim} and num_heads={num_heads} instead")
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads, self.dropout, self.batch_first = num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            # PyTorch's exception type, so code that catches it keeps working
            raise AssertionError("embed_dim must be divisible by num_heads")
        if self._qkv_same_embed_dim:
            self.in_proj_weight = parameter((3 * embed_dim, embed_dim), dtype, device)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = parameter((embed_dim, embed_dim), dtype, device)
            self.k_proj_weight = parameter((embed_dim, self.kdim), dtype, device)
            self.v_proj_weight = parameter((embed_dim, self.vdim), dtype, device)
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = parameter((3 * embed_dim,), dtype, device)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias,
                                                        device=device, dtype=dtype)
        if add_bias_kv:
            self.bias_k = parameter((1, 1, embed_dim), dtype, device)
            self.bias_v = parameter((1, 1, embed_dim), dtype, device)
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            init.xavier_normal_(self.bias_v)

    def _projections(self, query, key, value):
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b = self.in_proj_bias
        b_q, b_k, b_v = (None, None, None) if b is None else (b[:e], b[e:2 * e], b[2 * e:])
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """(output, weights): output like ``query``; weights (N, L, S) averaged over heads, or
        (N, num_heads, L, S) with ``average_attn_weights=False``, or None without
        ``need_weights``. Masks: boolean True = may not attend, float = added to the scores;
        ``attn_mask`` (L, S) or (N * num_heads, L, S), ``key_padding_mask`` (N, S).
        ``is_causal`` is only a hint that ``attn_mask`` is the causal mask (which must come)."""
        batched = query.ndim == 3
        if query.ndim not in (2, 3):
            raise AssertionError(f"query should be unbatched 2D or batched 3D tensor but "
                                 f"received {query.ndim}-D query tensor")
        if key.ndim != query.ndim or value.ndim != query.ndim:
            raise AssertionError(f"For {'batched' if batched else 'unbatched'} "
                                 f"({query.ndim}-D) `query`, expected `key` and `value` to be "
                                 f"{query.ndim}-D but found {key.ndim}-D and {value.ndim}-D "
                                 f"tensors respectively")
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                               "Transformer module method `generate_square_subsequent_mask` to "
                               "create this mask.")
        if self.batch_first and batched:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        if not batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights,
                                    attn_mask, average_attn_weights)
        if self.batch_first and batched:
            out = out.transpose(1, 0)
        if not batched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average):
        """The seq-first (L, N, E) computation of F.multi_head_attention_forward."""
        tgt_len, bsz, embed_dim = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        if embed_dim != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but "
                                 f"got {embed_dim}")
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {tuple(key.shape[:2])} do not "
                                 f"match value's {tuple(value.shape[:2])}")
        key_padding_mask = _float_mask(key_padding_mask, "key_padding_mask", query)
        attn_mask = _float_mask(attn_mask, "attn_mask", query)
        q, k, v = self._projections(query, key, value)
        src_len = k.shape[0]
        if attn_mask is not None:
            if attn_mask.ndim == 2:
                if tuple(attn_mask.shape) != (tgt_len, src_len):
                    raise RuntimeError(f"The shape of the 2D attn_mask is "
                                       f"torch.Size({list(attn_mask.shape)}), but should be "
                                       f"{(tgt_len, src_len)}.")
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask.ndim == 3:
                if tuple(attn_mask.shape) != (bsz * heads, tgt_len, src_len):
                    raise RuntimeError(f"The shape of the 3D attn_mask is "
                                       f"torch.Size({list(attn_mask.shape)}), but should be "
                                       f"{(bsz * heads, tgt_len, src_len)}.")
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.ndim} is not supported")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (bsz, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                 f"torch.Size({list(key_padding_mask.shape)})")
        if self.bias_k is not None:  # one more key (and value) every query may attend to
            k = cat([k, self.bias_k.expand(1, bsz, embed_dim)])
            v = cat([v, self.bias_v.expand(1, bsz, embed_dim)])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask,
                                                                           (0, 1))
        # (len, N, E) -> (N * heads, len, head_dim)
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:  # one more all-zero key and value
            k = cat([k, k.new_zeros(bsz * heads, 1, head_dim)], dim=1)
            v = cat([v, v.new_zeros(bsz * heads, 1, head_dim)], dim=1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask,
                                                                           (0, 1))
        src_len = k.shape[1]
        if key_padding_mask is not None:
            pad = key_padding_mask.reshape(bsz, 1, 1, src_len).expand(bsz, heads, 1, src_len)
            pad = pad.reshape(bsz * heads, 1, src_len)
            attn_mask = pad if attn_mask is None else attn_mask + pad
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = scores.softmax(-1)  # a fully masked row is NaN here, as PyTorch's
            if dropout_p > 0.0:
                weights = F.dropout(weights, dropout_p)
            out = (weights @ v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            out = self.out_proj(out).reshape(tgt_len, bsz, embed_dim)
            weights = weights.reshape(bsz, heads, tgt_len, src_len)
            return out, (weights.mean(1) if average else weights)
        if attn_mask is not None:
            whole = attn_mask.shape[0] == 1  # one (L, S) mask for every batch and head
            attn_mask = attn_mask.reshape(1 if whole else bsz, 1 if whole else heads, -1,
                                          src_len)
        out = scaled_dot_product_attention(q.reshape(bsz, heads, tgt_len, head_dim),
                                           k.reshape(bsz, heads, src_len, head_dim),
                                           v.reshape(bsz, heads, src_len, head_dim),
                                           attn_mask, dropout_p)
        out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)
        return self.out_proj(out).reshape(tgt_len, bsz, embed_dim), None
