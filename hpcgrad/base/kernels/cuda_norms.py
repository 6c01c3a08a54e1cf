"""CUDA kernels (numba.cuda) for BatchNorm, LayerNorm and softmax: the CPU passes on cupy arrays."""

import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64

from hpcgrad.base import backend
from hpcgrad.base.kernels.cuda import THREADS_PER_BLOCK, _device_view, _stream

# Note [Norms on CUDA]
# ~~~~~~~~~~~~~~~~~~~~
# kernels/batchnorm.py, layernorm.py and softmax.py fuse BatchNorm, LayerNorm and softmax into a
# few passes on the CPU; on a GPU their numpy formulas ran on cupy arrays, one kernel (and one
# temporary) per operation. These are the same passes for cupy arrays, with the same formulas,
# accumulators and public functions (``batchnorm``, ``layernorm``, ``softmax`` below take the
# CPU modules' calls), so the wrappers in nn/_functions.py, nn/_layernorm.py and ops/nn.py only
# choose the module by where the arrays live. Every kernel sees flat views (cuda.py's
# ``_device_view``, Note [Device views by address]) and indexes them itself, and launches on
# cupy's current stream without a host synchronize.
#
# A row reduction is one block per row (LayerNorm, softmax): each thread strides over the row,
# then the block adds (or takes the maximum of) the threads' values in shared memory, a tree of
# log2(threads) steps. The block size is a power of two, the smallest one of at least a warp
# that covers the row, up to REDUCE_THREADS, so a short row does not launch 256 threads to idle.
#
# A channel's reduction (BatchNorm's statistics and backward sums) is longer: N*H*W elements,
# 400K for a ResNet's first layer at batch 32, over 64 channels, fewer than an H200's 132 SMs.
# So a channel is cut into pieces of at least ELEMENTS_PER_THREAD elements a thread, one block
# each (a grid of channels x pieces), and a second launch of one thread per channel combines
# the pieces. The statistics stay two-pass: a block takes its piece's mean, then the squares
# about it (4096 elements: the second read is likely an L2 hit), and the combine is Chan's:
# mean = sum(n_s m_s) / N, M2 = sum(M2_s + n_s (m_s - mean)^2), with no E[x^2] - mean^2
# cancellation. LayerNorm's weight and bias gradients are column sums: one thread per column
# walks a chunk of ROWS_PER_CHUNK rows (coalesced across a warp), a grid of column blocks x row
# chunks, then one thread per column adds the chunks' sums. BatchNorm accumulates in float64
# whatever the dtype (as the CPU pass); LayerNorm and softmax in the input's dtype (as the CPU
# passes and PyTorch's acc type for float32). Element-wise passes (BatchNorm's transform and
# input gradient) are one thread per element, ELEMENT_THREADS to a block. Written and tested
# under the simulator; the piece and chunk sizes are first guesses, to tune on a GPU.

REDUCE_THREADS = 256  # the largest reduction block; a power of two, at most _SCRATCH
ELEMENT_THREADS = THREADS_PER_BLOCK  # an element-wise pass's block
ELEMENTS_PER_THREAD = 16  # the least a thread adds of a BatchNorm channel's piece
ROWS_PER_CHUNK = 64  # the rows a thread adds of one LayerNorm parameter-gradient column
# (the simulator's tests lower all four: it runs every thread of a block as a Python thread)
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis
_SCRATCH = 256  # the shared scratch of one block reduction (compiled into the kernels)
_WARP = 32


# --- block reductions: every thread gets the block's result -----------------------------------
@cuda.jit(device=True)
def _block_sum(scratch, value):
    t = cuda.threadIdx.x
    scratch[t] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            scratch[t] += scratch[t + step]
        cuda.syncthreads()
        step //= 2
    total = scratch[0]
    cuda.syncthreads()  # every thread has read it before the scratch is written again
    return total


@cuda.jit(device=True)
def _block_max(scratch, value):
    # a nan anywhere makes the maximum nan, as numpy's max
    t = cuda.threadIdx.x
    scratch[t] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            other = scratch[t + step]
            if other > scratch[t] or other != other:
                scratch[t] = other
        cuda.syncthreads()
        step //= 2
    found = scratch[0]
    cuda.syncthreads()
    return found


def _threads(n):
    """The reduction block for ``n`` elements: a power of two, a warp at least, REDUCE_THREADS
    at most."""
    threads = min(_WARP, REDUCE_THREADS)
    while threads < n and threads < REDUCE_THREADS:
        threads *= 2
    return min(threads, REDUCE_THREADS)


def _pieces(count):
    """(threads, piece, pieces) of a BatchNorm channel of ``count`` elements (Note [Norms on
    CUDA]): a block's piece is at least ELEMENTS_PER_THREAD elements a thread."""
    threads = _threads(count)
    piece = max(threads * ELEMENTS_PER_THREAD, -(-count // _MAX_GRID_Y))
    return threads, piece, -(-count // piece)


def _grid(n):
    """(blocks, threads) of an element-wise pass over ``n`` elements."""
    return (n + ELEMENT_THREADS - 1) // ELEMENT_THREADS, ELEMENT_THREADS


# --- BatchNorm: x as (N, C, L) flat; a channel's sums in pieces, a block each -----------------
@cuda.jit
def _bn_stats_pieces(x, channels, length, piece, mean_part, m2_part):
    # a piece's count, mean and squares about that mean (two passes over the piece)
    ch, s, pieces = cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.y
    t, step = cuda.threadIdx.x, cuda.blockDim.x
    count = x.size // channels
    start = s * piece
    stop = min(start + piece, count)
    scratch = cuda.shared.array(_SCRATCH, float64)
    # (i, k) advance by the block's step without a division per element
    step_i, step_k = step // length, step % length
    total = float64(0.0)
    i, k = (start + t) // length, (start + t) % length
    for _ in range(start + t, stop, step):
        total += x[(i * channels + ch) * length + k]
        i, k = i + step_i, k + step_k
        if k >= length:
            i, k = i + 1, k - length
    m = _block_sum(scratch, total) / (stop - start)
    squares = float64(0.0)
    i, k = (start + t) // length, (start + t) % length
    for _ in range(start + t, stop, step):
        d = x[(i * channels + ch) * length + k] - m
        squares += d * d
        i, k = i + step_i, k + step_k
        if k >= length:
            i, k = i + 1, k - length
    squares = _block_sum(scratch, squares)
    if t == 0:
        mean_part[ch * pieces + s], m2_part[ch * pieces + s] = m, squares


@cuda.jit
def _bn_stats_combine(mean_part, m2_part, pieces, count, piece, mean, var):
    ch = cuda.grid(1)
    if ch < mean.size:
        total = float64(0.0)
        for s in range(pieces):
            total += min(piece, count - s * piece) * mean_part[ch * pieces + s]
        m = total / count
        m2 = float64(0.0)
        for s in range(pieces):
            d = mean_part[ch * pieces + s] - m
            m2 += m2_part[ch * pieces + s] + min(piece, count - s * piece) * d * d
        mean[ch], var[ch] = m, m2 / count


@cuda.jit
def _bn_transform(x, alpha, beta, channels, length, out):
    j = cuda.grid(1)
    if j < x.size:  # the last block runs past the end
        ch = (j // length) % channels
        out[j] = x[j] * alpha[ch] + beta[ch]


@cuda.jit
def _bn_backward_pieces(g, y, masked, x, mean, channels, length, piece, sum_part, dot_part):
    # masked: g taken as 0 where y <= 0 (a relu folded into BatchNorm's Node, Note [Folded
    # in-place ops]); unmasked launches pass g as y
    ch, s, pieces = cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.y
    t, step = cuda.threadIdx.x, cuda.blockDim.x
    count = x.size // channels
    start = s * piece
    stop = min(start + piece, count)
    scratch = cuda.shared.array(_SCRATCH, float64)
    step_i, step_k = step // length, step % length
    m = mean[ch]
    total = float64(0.0)
    dot = float64(0.0)
    i, k = (start + t) // length, (start + t) % length
    for _ in range(start + t, stop, step):
        at = (i * channels + ch) * length + k
        gv = float64(g[at])
        if masked and y[at] <= 0:
            gv = float64(0.0)
        total += gv
        dot += gv * (x[at] - m)
        i, k = i + step_i, k + step_k
        if k >= length:
            i, k = i + 1, k - length
    total = _block_sum(scratch, total)
    dot = _block_sum(scratch, dot)
    if t == 0:
        sum_part[ch * pieces + s], dot_part[ch * pieces + s] = total, dot


@cuda.jit
def _add_pieces(part_a, part_b, pieces, out_a, out_b):
    # out[c] = the sum of part[c, :] for two tables of pieces (C, pieces) at once
    c = cuda.grid(1)
    if c < out_a.size:
        a = part_a[c * pieces]
        b = part_b[c * pieces]
        for s in range(1, pieces):
            a += part_a[c * pieces + s]
            b += part_b[c * pieces + s]
        out_a[c], out_b[c] = a, b


@cuda.jit
def _bn_backward_input(g, y, masked, zero, x, mean, grad_mean, k_coeff, scale, channels, length,
                       out):
    # zero: 0 in g's dtype (an exact 0 where y <= 0, even for an inf or nan g, as relu's backward)
    j = cuda.grid(1)
    if j < x.size:
        ch = (j // length) % channels
        gv = g[j]
        if masked and y[j] <= 0:
            gv = zero
        out[j] = (gv - grad_mean[ch] - (x[j] - mean[ch]) * k_coeff[ch]) * scale[ch]


# --- LayerNorm and softmax: rows of n, one block per row; sums in the dtype --------------------
def _row_kernels(acc):
    """LayerNorm's and softmax's kernels for one dtype ``acc`` (float32 or float64)."""

    @cuda.jit
    def layer_norm_forward(x, n, weight, has_weight, bias, has_bias, eps, out, mean, rstd):
        base = cuda.blockIdx.x * n
        t, step = cuda.threadIdx.x, cuda.blockDim.x
        scratch = cuda.shared.array(_SCRATCH, acc)
        total = acc(0)
        for k in range(t, n, step):
            total += x[base + k]
        m = _block_sum(scratch, total) / acc(n)
        squares = acc(0)
        for k in range(t, n, step):
            d = x[base + k] - m
            squares += d * d
        r = acc(1) / math.sqrt(_block_sum(scratch, squares) / acc(n) + eps)
        for k in range(t, n, step):
            w = weight[k] if has_weight else acc(1)
            b = bias[k] if has_bias else acc(0)
            out[base + k] = (x[base + k] - m) * r * w + b
        if t == 0:
            mean[cuda.blockIdx.x], rstd[cuda.blockIdx.x] = m, r

    @cuda.jit
    def layer_norm_backward_input(g, x, n, weight, has_weight, mean, rstd, grad_x):
        row = cuda.blockIdx.x
        base = row * n
        t, step = cuda.threadIdx.x, cuda.blockDim.x
        scratch = cuda.shared.array(_SCRATCH, acc)
        m, r = mean[row], rstd[row]
        sum_gw = acc(0)
        sum_gwx = acc(0)
        for k in range(t, n, step):
            gw = g[base + k] * (weight[k] if has_weight else acc(1))
            sum_gw += gw
            sum_gwx += gw * ((x[base + k] - m) * r)
        a = _block_sum(scratch, sum_gw) / acc(n)
        c = _block_sum(scratch, sum_gwx) / acc(n)
        for k in range(t, n, step):
            gw = g[base + k] * (weight[k] if has_weight else acc(1))
            grad_x[base + k] = r * (gw - a - (x[base + k] - m) * r * c)

    @cuda.jit
    def layer_norm_backward_columns(g, x, rows, n, mean, rstd, chunk, part_w, part_b):
        # column k's sums over the rows of chunk blockIdx.y, into part[blockIdx.y, k]
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if k < n:
            sum_w = acc(0)
            sum_b = acc(0)
            for i in range(cuda.blockIdx.y * chunk, min((cuda.blockIdx.y + 1) * chunk, rows)):
                gv = g[i * n + k]
                sum_w += gv * ((x[i * n + k] - mean[i]) * rstd[i])
                sum_b += gv
            part_w[cuda.blockIdx.y * n + k], part_b[cuda.blockIdx.y * n + k] = sum_w, sum_b

    @cuda.jit
    def column_totals(part_w, part_b, chunks, n, grad_w, grad_b):
        k = cuda.grid(1)
        if k < n:
            sum_w = acc(0)
            sum_b = acc(0)
            for c in range(chunks):
                sum_w += part_w[c * n + k]
                sum_b += part_b[c * n + k]
            grad_w[k], grad_b[k] = sum_w, sum_b

    @cuda.jit
    def softmax_forward(x, n, dead_value, out):
        base = cuda.blockIdx.x * n
        t, step = cuda.threadIdx.x, cuda.blockDim.x
        scratch = cuda.shared.array(_SCRATCH, acc)
        m = acc(-math.inf)
        for k in range(t, n, step):
            v = x[base + k]
            if v > m or v != v:
                m = v
        m = _block_max(scratch, m)
        if m == -math.inf:  # every element -inf (the whole block takes this branch)
            for k in range(t, n, step):
                out[base + k] = dead_value
            return
        total = acc(0)
        for k in range(t, n, step):  # a nan maximum makes every exp, and the sum, nan: numpy's
            e = math.exp(x[base + k] - m)
            out[base + k] = e
            total += e
        total = _block_sum(scratch, total)
        for k in range(t, n, step):  # each thread reads back only what it wrote
            out[base + k] = out[base + k] / total

    @cuda.jit
    def softmax_backward(p, g, n, scale, out):
        base = cuda.blockIdx.x * n
        t, step = cuda.threadIdx.x, cuda.blockDim.x
        scratch = cuda.shared.array(_SCRATCH, acc)
        dot = acc(0)
        for k in range(t, n, step):
            dot += g[base + k] * p[base + k]
        dot = _block_sum(scratch, dot)
        for k in range(t, n, step):
            out[base + k] = p[base + k] * (g[base + k] - dot) * scale

    return SimpleNamespace(layer_norm_forward=layer_norm_forward,
                           layer_norm_backward_input=layer_norm_backward_input,
                           layer_norm_backward_columns=layer_norm_backward_columns,
                           column_totals=column_totals,
                           softmax_forward=softmax_forward, softmax_backward=softmax_backward)


_ROWS = {np.dtype(np.float32): _row_kernels(float32), np.dtype(np.float64): _row_kernels(float64)}


# --- wrappers: the CPU modules' calls on cupy arrays (numpy arrays under the simulator) ----------
def _on_device(*arrays):
    """Whether every array is a cupy array (the wiring's test; replaced under the simulator)."""
    return all(backend.is_gpu_array(a) for a in arrays)


def _floats(*arrays):
    """C-contiguous float32/float64 arrays of one dtype."""
    first = arrays[0]
    return first.dtype in (np.float32, np.float64) and all(
        a.dtype == first.dtype and a.flags.c_contiguous for a in arrays)


def _view(a):
    return _device_view(a, a.dtype)


def _per_channel(a, coeff, dtype):
    """A per-channel coefficient (host or device, any dtype) as a device array of ``dtype``."""
    xp = backend.get_array_module(a)
    return xp.ascontiguousarray(xp.asarray(coeff, dtype=dtype).reshape(-1))


def bn_typed(*arrays):
    """Whether the BatchNorm kernels take these: cupy, C-contiguous float32/float64 of one
    dtype, at least (N, C) (as kernels/batchnorm.py's ``typed`` for numpy)."""
    return _on_device(*arrays) and _floats(*arrays) and arrays[0].ndim >= 2


def _ncl(x):
    n, c = x.shape[0], x.shape[1]
    return n, c, x.size // (n * c) if x.size else int(np.prod(x.shape[2:]))


def bn_stats(x):
    """(mean, biased variance) per channel of x (N, C, ...), in float64 (nan for an empty
    batch, as numpy's mean)."""
    xp = backend.get_array_module(x)
    _, c, length = _ncl(x)
    mean, var = xp.empty(c), xp.empty(c)
    if x.size == 0:
        mean[...] = var[...] = np.nan
        return mean, var
    count = x.size // c
    threads, piece, pieces = _pieces(count)
    mean_part, m2_part = xp.empty(c * pieces), xp.empty(c * pieces)
    stream = _stream(x)
    _bn_stats_pieces[(c, pieces), threads, stream](_view(x), c, length, piece,
                                                   _view(mean_part), _view(m2_part))
    _bn_stats_combine[(*_grid(c), stream)](_view(mean_part), _view(m2_part), pieces, count,
                                           piece, _view(mean), _view(var))
    return mean, var


def bn_transform(x, alpha, beta):
    """``x * alpha + beta`` with alpha and beta per channel (cast to x's dtype)."""
    xp = backend.get_array_module(x)
    out = xp.empty_like(x)
    if x.size == 0:
        return out
    _, c, length = _ncl(x)
    _bn_transform[(*_grid(x.size), _stream(x))](
        _view(x), _view(_per_channel(x, alpha, x.dtype)), _view(_per_channel(x, beta, x.dtype)),
        c, length, _view(out))
    return out


def bn_backward_sums(g, x, mean, relu_out=None):
    """(sum(g), sum(g * (x - mean))) per channel, in float64; with ``relu_out``, of g taken as 0
    where relu_out <= 0 (kernels/batchnorm.py's call)."""
    xp = backend.get_array_module(x)
    _, c, length = _ncl(x)
    sum_g, dotp = xp.zeros(c), xp.zeros(c)
    if x.size == 0:
        return sum_g, dotp
    threads, piece, pieces = _pieces(x.size // c)
    sum_part, dot_part = xp.empty(c * pieces), xp.empty(c * pieces)
    stream = _stream(x)
    _bn_backward_pieces[(c, pieces), threads, stream](
        _view(g), _view(g if relu_out is None else relu_out), relu_out is not None, _view(x), _view(_per_channel(x, mean, np.float64)), c, length, piece,
        _view(sum_part), _view(dot_part))
    _add_pieces[(*_grid(c), stream)](_view(sum_part), _view(dot_part), pieces, _view(sum_g),
                                     _view(dotp))
    return sum_g, dotp


def bn_backward_input(g, x, mean, grad_mean, k_coeff, scale, relu_out=None):
    """``(g - grad_mean - (x - mean) * k_coeff) * scale``, each coefficient per channel; with
    ``relu_out``, g taken as 0 where relu_out <= 0."""
    xp = backend.get_array_module(x)
    out = xp.empty_like(g)
    if x.size == 0:
        return out
    _, c, length = _ncl(x)
    coeffs = [_view(_per_channel(x, v, g.dtype)) for v in (mean, grad_mean, k_coeff, scale)]
    _bn_backward_input[(*_grid(x.size), _stream(x))](
        _view(g), _view(g if relu_out is None else relu_out), relu_out is not None,
        g.dtype.type(0), _view(x), *coeffs, c, length, _view(out))
    return out


def ln_typed(*arrays):
    """Whether the LayerNorm kernels take these: cupy, C-contiguous float32/float64 of one
    dtype, not empty (as kernels/layernorm.py's ``typed`` for numpy)."""
    return _on_device(*arrays) and _floats(*arrays) and arrays[0].size > 0


def _affine(a, weight, n):
    """(the flat parameter or ``a`` as a placeholder, whether there is one)."""
    return (a, False) if weight is None else (weight.reshape(n), True)


def ln_forward(a, count, weight, bias, eps):
    """(out, mean, rstd) of LayerNorm over the trailing ``count`` axes of ``a``; mean and rstd
    keep those axes as 1s (as the reference's keepdims)."""
    xp = backend.get_array_module(a)
    n = int(np.prod(a.shape[a.ndim - count:]))
    rows = a.size // n if n else 0
    out = xp.empty_like(a)
    mean, rstd = xp.empty(rows, a.dtype), xp.empty(rows, a.dtype)
    if rows and n:
        (w, has_w), (b, has_b) = _affine(a, weight, n), _affine(a, bias, n)
        _ROWS[a.dtype].layer_norm_forward[rows, _threads(n), _stream(a)](
            _view(a), n, _view(w), has_w, _view(b), has_b, a.dtype.type(eps), _view(out),
            _view(mean), _view(rstd))
    kept = a.shape[:a.ndim - count] + (1,) * count
    return out, mean.reshape(kept), rstd.reshape(kept)


def ln_backward(g, a, weight, mean, rstd, count, need_x):
    """(grad_x or None, grad_weight, grad_bias); the last two over the normalized axes' shape."""
    xp = backend.get_array_module(a)
    shape = a.shape[a.ndim - count:]
    n = int(np.prod(shape))
    rows = a.size // n if n else 0
    grad_x = xp.empty_like(a) if need_x else None
    grad_w, grad_b = xp.zeros(n, a.dtype), xp.zeros(n, a.dtype)
    if rows and n:
        kernels, stream = _ROWS[a.dtype], _stream(a)
        mean, rstd = _view(xp.ascontiguousarray(mean)), _view(xp.ascontiguousarray(rstd))
        if need_x:
            w, has_w = _affine(a, weight, n)
            kernels.layer_norm_backward_input[rows, _threads(n), stream](
                _view(g), _view(a), n, _view(w), has_w, mean, rstd, _view(grad_x))
        chunk = max(ROWS_PER_CHUNK, -(-rows // _MAX_GRID_Y))
        chunks = -(-rows // chunk)
        # one chunk: its sums are the gradients; more: a table of them, then their totals
        part_w, part_b = (grad_w, grad_b) if chunks == 1 else (
            xp.empty(chunks * n, a.dtype), xp.empty(chunks * n, a.dtype))
        blocks, threads = _grid(n)
        kernels.layer_norm_backward_columns[(blocks, chunks), threads, stream](
            _view(g), _view(a), rows, n, mean, rstd, chunk, _view(part_w),
            _view(part_b))
        if chunks > 1:
            kernels.column_totals[blocks, threads, stream](
                _view(part_w), _view(part_b), chunks, n, _view(grad_w), _view(grad_b))
    return grad_x, grad_w.reshape(shape), grad_b.reshape(shape)


def sm_forward_typed(a):
    """Whether softmax_rows takes ``a``: a C-contiguous cupy float32/float64 with a last axis."""
    return _on_device(a) and _floats(a) and a.ndim >= 1 and a.size > 0


def sm_backward_typed(p, g):
    """Whether softmax_backward_rows takes these: C-contiguous cupy float32/float64 of one dtype
    and shape."""
    return _on_device(p, g) and _floats(p, g) and p.shape == g.shape and p.ndim >= 1 \
        and p.size > 0


def softmax_rows(a, dead_zero):
    """softmax over the last axis of ``a``; a row of only -inf gives 0s if ``dead_zero``
    (attention's masked rows), else nan (softmax's own result)."""
    out = backend.get_array_module(a).empty_like(a)
    n = a.shape[-1] if a.ndim else 1
    if a.size:
        _ROWS[a.dtype].softmax_forward[a.size // n, _threads(n), _stream(a)](
            _view(a), n, a.dtype.type(0.0 if dead_zero else np.nan), _view(out))
    return out


def softmax_backward_rows(p, g, scale=1.0):
    """``p * (g - sum(g * p, -1)) * scale`` row by row: softmax's backward (times ``scale``)."""
    out = backend.get_array_module(p).empty_like(p)
    n = p.shape[-1] if p.ndim else 1
    if p.size:
        _ROWS[p.dtype].softmax_backward[p.size // n, _threads(n), _stream(p)](
            _view(p), _view(g), n, p.dtype.type(scale), _view(out))
    return out


# The CPU modules' names, for the wrappers that pick a module by where the arrays live.
batchnorm = SimpleNamespace(typed=bn_typed, stats=bn_stats, transform=bn_transform,
                            backward_sums=bn_backward_sums, backward_input=bn_backward_input)
layernorm = SimpleNamespace(typed=ln_typed, forward=ln_forward, backward=ln_backward)
softmax = SimpleNamespace(forward_typed=sm_forward_typed, backward_typed=sm_backward_typed,
                          softmax_rows=softmax_rows, softmax_backward_rows=softmax_backward_rows)
