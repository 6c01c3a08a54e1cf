"""Direct convolution in numba (256- or 512-bit vectors): forward and weight gradient, no columns.

Note [Direct convolution]
~~~~~~~~~~~~~~~~~~~~~~~~~
At 16-32 channels the columns' product (nn/_conv.py, Note [Convolution columns]) is a GEMM with
16-32 rows, which OpenBLAS runs at 30-46 GF/s on one core, and the columns and the transposed
store cost 0.3-0.45x on top of it. PyTorch's oneDNN runs a direct convolution there; this is one.

The forward. Each block is 4 output channels x 2 vectors of output (16 float32 or 8 float64
positions of a row, or, where a row is one vector long, that position range of two rows) as 8
accumulators that stay in registers through the taps (input channel, kernel row, kernel column)
of a chunk of 16 input channels: per tap two unaligned loads of the padded input at the tap's
offset, four broadcast weights, eight fused multiply-adds; the next chunk adds to what the first
stored. A block of output channels sweeps a sample's rows with the chunk's weights in L1. LLVM
keeps a value in a register only when it is one; numba has no vector type, so kernels/vectors.py
gives it one (``Vec``) with intrinsics: load, a load of two half rows, store, splat and a
multiply-add with LLVM's ``contract`` flag (fused where the CPU has FMA, a multiply and an add
where it has not: the same code is correct on any x86 or ARM CPU). The tap's offset and its weights
are read with ``sload``, not numba's indexing, whose turn of a negative index into one from the
end (three integer operations a read, nine reads a tap) held the loop to 0.8x the speed: 32
channels of 16x16 at batch 32 went from 47 to 55 GF/s, the forward from 1.33x PyTorch's time to
1.03x (2026-11-29, a throwaway script timing both interleaved).

On a CPU with AVX-512 (32 vector registers: ``WIDTHS``, ``OUTPUTS``) a block is 8 output
channels x 2 vectors, 16 accumulators; rows of 32k or 16 float32 positions take 512-bit vectors,
and 8x8 planes too, each vector two rows of 8 loaded as halves, four rows a block (rows of 4,
four quarters a vector, ran at 50 GF/s: slower than the columns at 128-512 channels). On
ResNet-18's 3x3 layers at batch 32 (Xeon, Cascade Lake, one thread), 16 channels of 32x32 ran at
72-77 GF/s where 256 x 4 ran at 36-41 and PyTorch at 43-51; 32 of 16x16 at 78-86 against 38-40
and 71-77; 64 of 8x8 at 73 against 40 and 79 (``python benchmarks/conv_layouts.py --direct``).
Strided convolutions (``conv2d_strided``) run the same kernel over the padded input split into
its stride's phases, phase (p, q) holding positions (sh*y + p, sw*x + q): each tap then reads a
run of one phase's row (one copy of the input, where columns are kh*kw of it), 8 input channels
a pass (four phase planes each must stay in L1): ResNet-18's stride-2 forwards in 0.57-0.65x the
columns' time. The split into phases (``_split_phases``) is one numba pass taking each phase
row's run at stride 2 by whole vectors (``vload_even``): numpy's strided slices, and numba's
own loop (which gathers), took 2.5-3.5x its time, a third of the strided forward at 16
channels of 32x32; with it that forward went from 1.37x PyTorch's time to 1.19x. The weight
gradient runs over the same phases (``weight_grad_strided``).

Note [Padding as the kernels go]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The stride-1 kernels read a zero-padded input, and its padded copy (a zeroed array, the input
written into it) was 6% of a ResNet-18 step at width 16: 23 copies a step (the forward's input,
the input gradient's incoming gradient, the weight gradient's input again), 0.84 ms each for
16 channels of 32x32 at batch 32, and the kernel then read the copy back from memory. Given
``padding``, the kernels take the input unpadded and make its padded planes themselves, in a
small workspace whose zero borders are written once: the forward a sample's chunk of input
channels before the blocks of outputs sweep it (16 planes of 34x34 float32, 74 KB), the weight
gradient a pass's samples (``PASS_POSITIONS``). Strided kernels split the chunk's channels into
their phases there the same way (``_split_plane``, which at stride 1 is the padded plane).
Every fill writes the same places, so the workspace's zeros stay. The sums are those over the
padded copy (the whole input's phases), bit for bit: the same values at the same offsets. At
batch 32 (2026-11-29, interleaved, one thread), against the copy and the kernel: the forward of
16 channels of 32x32 0.67-0.78x, 32 of 16x16 0.84-0.93x, the stem 0.87-0.94x; the weight
gradient 0.79-0.82x, 0.91-0.98x, 0.90x; at stride 2 (16 -> 32 of 32x32, 32 -> 64 of 16x16, the
1x1 shortcut) the forward 0.72-0.90x and the weight gradient 0.81-0.91x. The width-16 step:
0.91x with the stride-1 kernels' padding (``benchmarks/models.py --alternate
hpcgrad.nn._conv._DIRECT_FILL=False,True``: 259.7 against 236.0 ms, PyTorch's 234.8), 0.955x
with both in a faster hour (187.9 against 179.5, PyTorch's 179.6). ``_DIRECT_FILL = False`` in
nn/_conv.py reads the whole copy (``whole=True``), the reference tests/nn/test_direct_conv.py
holds the kernels to.

The weight gradient (``weight_grad_stride1``): a block is 4 output channels x 6 taps at 512
bits (x 2 at 256), 24 accumulators, each lane summing g[n, k, p] * x[n, tap + p] over the
positions it sees, samples a pass enough for 1,024 positions, the lanes summed at the end. At
512 bits, with blocks of 4 x 4, it took 0.31-0.45x the columns' time at 3 channels of 32x32,
0.45-0.54x at 16 of 32x32, 0.69-0.87x at 32 of 16x16, and was no faster at 64-128 (256 bits,
the same CPU: 0.45x, 0.8x, 1.2x): taken up to 32 input channels at 512 bits, 16 at 256
(nn/_conv.py). Blocks of 4 x 6 (ten loads for 24 multiply-adds, where 4 x 4 has eight for 16)
took 0.92-0.94x the 4 x 4 one's time at 16 channels of 32x32 and 32 of 16x16 (2026-11-29,
interleaved, a throwaway generator of block shapes): 6 x 4 1.06-1.13x, 3 x 8 0.96-1.07x, 5 x 5
1.04-1.16x, 2 x 8 1.06-1.16x; samples a pass for 512 or 2,048 positions 0.93-1.05x. (An earlier
measure, on another day, had 4 x 6 at 0.95-1.0x.) Its sums are loaded and stored
in the loop itself: through a function returning 16 vectors, and with the scalar loop for a
row's last positions in the same loop, it ran 1.7-2.5x slower, so that loop is its own kernel.

Every (width, block) forward kernel sums each output's terms in the same order, so they agree
bit for bit (tests/nn/test_direct_conv.py checks it); the order is tap order (channel, kernel
row, kernel column), each product fused into the running sum where the CPU has FMA: not the
GEMM's order, so results agree with the columns' path to rounding, not to the bit. The weight
gradient's order (by lane, then the lanes) is not the columns' either.

What did not work (ResNet-18's 3x3 layers, batch 32, one thread, an AMD 2-core machine under
load, AVX2): numba's loop vectorizer over a whole output row, 2 outputs x 4 channels per pass
with the sums in an L1 buffer, ran at the GEMM's speed (the sums' loads and stores bound it); 64
scalar accumulators for LLVM's SLP vectorizer to pack stayed scalar, 20x slower; blocks of
(outputs x vectors) 2 x 4 and 1 x 8 were no faster than 4 x 2, 2 x 6 and 3 x 4 spill, and 4 x
3 (24 positions) divides no ResNet row. Positions past a row's last whole block take a scalar
loop, 10x slower: the selection in nn/_conv.py sends only rows without them here
(``whole_rows``), and only up to 32 input channels, 64 on planes of 8x8 or less: at 64 channels
of 16x16 and 32x32 the 256-bit kernel ran 0.8-1.3x the columns' time from run to run, at 128 no
faster. The block's ``_block`` is inlined into the loop by numba (``inline="always"``): as an
LLVM call it ran 1.5-1.9x slower. Compiling all of numba's loops for 512-bit vectors (LLVM's
``-prefer-256-bit`` off) made GELU 1.6x faster but the ResNet step slower: kernels/wide.py
widens chosen loops only (Note [512-bit loops]).
Figures: ``python benchmarks/conv_layouts.py --direct`` and docs/performance.rst.
"""

import functools
import math

import numpy as np
from numba import njit

from hpcgrad.base.kernels.vectors import (sload, vfma, vload, vload_even, vload_rows, vsplat,
                                          vstore)
from hpcgrad.base.kernels.wide import AVX512

BLOCK_VECTORS = 2  # vectors of one output row per pass
CHUNK_CHANNELS = 16  # input channels per pass over the outputs
STRIDED_CHUNK = 8  # input channels per pass at strides > 1: four phase planes each (L1)
PASS_POSITIONS = 1024  # the weight gradient's samples a pass: enough for this many positions
HALF_ROWS = True  # False: rows of half a 512-bit vector take 256-bit ones (a benchmark's switch)


@njit(nogil=True, fastmath={"contract"}, inline="always")  # compiled into _direct
def _block(xf, wpk, offs, of, base, second_in, wi, t0, t1, at, second_out, plane, live, per,
           zero, bits, rows_in, parts):
    """One block: ``per`` (4 or 8) output channels, ``live`` of them real, x 2 vectors, the
    second at ``second_in`` past the first in the input and ``second_out`` in the output (the
    next vector of the row, or the next row's), over taps [t0, t1): from zero at the first tap,
    else added to what ``of`` holds. ``per`` is a constant, so the unused half folds away.
    ``parts`` 2: rows of half a vector, each vector two input rows ``rows_in`` apart (1: each
    vector one run of a row)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vsplat(zero, bits)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = a0
    if t0:
        a0, b0 = vload(of, at, bits), vload(of, at + second_out, bits)
        if live > 1:
            a1, b1 = vload(of, at + plane, bits), vload(of, at + plane + second_out, bits)
        if live > 2:
            a2, b2 = vload(of, at + 2 * plane, bits), vload(of, at + 2 * plane + second_out, bits)
        if live > 3:
            a3, b3 = vload(of, at + 3 * plane, bits), vload(of, at + 3 * plane + second_out, bits)
        if live > 4:
            a4, b4 = vload(of, at + 4 * plane, bits), vload(of, at + 4 * plane + second_out, bits)
        if live > 5:
            a5, b5 = vload(of, at + 5 * plane, bits), vload(of, at + 5 * plane + second_out, bits)
        if live > 6:
            a6, b6 = vload(of, at + 6 * plane, bits), vload(of, at + 6 * plane + second_out, bits)
        if live > 7:
            a7, b7 = vload(of, at + 7 * plane, bits), vload(of, at + 7 * plane + second_out, bits)
    for t in range(t0, t1):
        s = base + sload(offs, t)
        if parts == 2:
            u = vload_rows(xf, s, rows_in, 2, bits)
            v = vload_rows(xf, s + second_in, rows_in, 2, bits)
        else:
            u = vload(xf, s, bits)
            v = vload(xf, s + second_in, bits)
        w = vsplat(sload(wpk, wi), bits)
        a0, b0 = vfma(w, u, a0), vfma(w, v, b0)
        w = vsplat(sload(wpk, wi + 1), bits)
        a1, b1 = vfma(w, u, a1), vfma(w, v, b1)
        w = vsplat(sload(wpk, wi + 2), bits)
        a2, b2 = vfma(w, u, a2), vfma(w, v, b2)
        w = vsplat(sload(wpk, wi + 3), bits)
        a3, b3 = vfma(w, u, a3), vfma(w, v, b3)
        if per > 4:
            w = vsplat(sload(wpk, wi + 4), bits)
            a4, b4 = vfma(w, u, a4), vfma(w, v, b4)
            w = vsplat(sload(wpk, wi + 5), bits)
            a5, b5 = vfma(w, u, a5), vfma(w, v, b5)
            w = vsplat(sload(wpk, wi + 6), bits)
            a6, b6 = vfma(w, u, a6), vfma(w, v, b6)
            w = vsplat(sload(wpk, wi + 7), bits)
            a7, b7 = vfma(w, u, a7), vfma(w, v, b7)
        wi += per
    vstore(of, at, a0)
    vstore(of, at + second_out, b0)
    if live > 1:
        vstore(of, at + plane, a1)
        vstore(of, at + plane + second_out, b1)
    if live > 2:
        vstore(of, at + 2 * plane, a2)
        vstore(of, at + 2 * plane + second_out, b2)
    if live > 3:
        vstore(of, at + 3 * plane, a3)
        vstore(of, at + 3 * plane + second_out, b3)
    if live > 4:
        vstore(of, at + 4 * plane, a4)
        vstore(of, at + 4 * plane + second_out, b4)
    if live > 5:
        vstore(of, at + 5 * plane, a5)
        vstore(of, at + 5 * plane + second_out, b5)
    if live > 6:
        vstore(of, at + 6 * plane, a6)
        vstore(of, at + 6 * plane + second_out, b6)
    if live > 7:
        vstore(of, at + 7 * plane, a7)
        vstore(of, at + 7 * plane + second_out, b7)


@njit(nogil=True, fastmath={"contract"}, inline="always")  # compiled into _direct
def _position(xf, wpk, offs, of, base, wi, t0, t1, at, plane, live, per, zero):
    """``_block`` for one output position, without vectors (a row's last positions): each
    output's terms in the same order, so the same sums."""
    for j in range(live):
        total = of[at + j * plane] if t0 else zero
        for t in range(t0, t1):
            total += wpk[wi + (t - t0) * per + j] * xf[base + offs[t]]
        of[at + j * plane] = total


@njit(nogil=True, inline="always")
def _fill(xs, space, at, n, c0, c1, fill, hq, wq, bits):
    # Channels [c0, c1) of sample n of the unpadded input xs (flat; fill: (C, H, W, top, left,
    # sh, sw)) split into their phases (stride 1: the padded planes) in ``space`` from ``at``,
    # where the zeros around them are already (every fill writes the same places).
    c_, height, width, top, left, sh, sw = fill
    d = at
    for ci in range(c0, c1):
        d = _split_plane(xs, ((n * c_ + ci) * height) * width, space, d, height, width, sh,
                         sw, hq, wq, top, left, bits, False)


@njit(nogil=True, fastmath={"contract"})
def _direct(xf, wpk, offs, out, sample, wp, chunk, zero, bits, per, xs, fill):
    # xf: the padded input, flat; sample: its elements per sample; wp: its row's length.
    # wpk: (K blocks, taps, per) flat, zeros past K; offs: each tap's offset in a sample; chunk:
    # taps per pass over the outputs (whole channels). out: (N, K, Ho, Wo). A block of channels
    # sweeps a chunk of the sample's channels with its weights (chunk * per) and the chunk's
    # rows around the current one in L1. bits and per are constants (the entry points below).
    # fill (C, H, W, top, left, sh, sw), C > 0: xf is a workspace of a chunk's padded planes
    # (their phases at a stride), zeros around them, filled here from the unpadded input xs a
    # sample's chunk at a time (Note [Padding as the kernels go]); C == 0: xf is the whole
    # padded input (its phases), and xs is not read.
    n_, k_, ho, wo = out.shape
    of = out.reshape(-1)
    taps = offs.size
    lanes = bits // (8 * xf.itemsize)
    blocks = (k_ + per - 1) // per
    plane = ho * wo
    filled = fill[0]
    for n in range(n_):
        for t0 in range(0, taps, chunk):
            t1 = min(t0 + chunk, taps)
            start = n * sample
            if filled:  # the chunk's channels padded into xf; start: where sample n would be
                per_channel = taps // filled
                c0 = t0 // per_channel
                _fill(xs, xf, 0, n, c0, (t1 + per_channel - 1) // per_channel, fill,
                      sample // (filled * fill[5] * fill[6] * wp), wp, bits)
                start = -c0 * (sample // filled)
            for kb in range(blocks):
                k0 = kb * per
                live = min(per, k_ - k0)
                wi = (kb * taps + t0) * per
                first = (n * k_ + k0) * plane
                y = 0
                while y < ho:
                    row = start + y * wp
                    if 2 * wo == lanes and y + 3 < ho:  # rows of half a vector: four a block
                        _block(xf, wpk, offs, of, row, 2 * wp, wi, t0, t1, first + y * wo,
                               lanes, plane, live, per, zero, bits, wp, 2)
                        y += 4
                        continue
                    if wo == lanes and y + 1 < ho:  # rows of one vector: two rows a block
                        _block(xf, wpk, offs, of, row, wp, wi, t0, t1, first + y * wo, wo,
                               plane, live, per, zero, bits, 0, 1)
                        y += 2
                        continue
                    x = 0
                    while x + 2 * lanes <= wo:
                        _block(xf, wpk, offs, of, row + x, lanes, wi, t0, t1,
                               first + y * wo + x, lanes, plane, live, per, zero, bits, 0, 1)
                        x += 2 * lanes
                    for x in range(x, wo):  # the row's last positions, one at a time
                        _position(xf, wpk, offs, of, row + x, wi, t0, t1, first + y * wo + x,
                                  plane, live, per, zero)
                    y += 1


@njit(cache=True, nogil=True, fastmath={"contract"})
def _direct_256x4(xf, wpk, offs, out, sample, wp, chunk, zero, xs, fill):
    _direct(xf, wpk, offs, out, sample, wp, chunk, zero, 256, 4, xs, fill)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _direct_256x8(xf, wpk, offs, out, sample, wp, chunk, zero, xs, fill):
    _direct(xf, wpk, offs, out, sample, wp, chunk, zero, 256, 8, xs, fill)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _direct_512x8(xf, wpk, offs, out, sample, wp, chunk, zero, xs, fill):
    _direct(xf, wpk, offs, out, sample, wp, chunk, zero, 512, 8, xs, fill)


# (vector bits, output channels per block): the kernel compiled for them
KERNELS = {(256, 4): _direct_256x4, (256, 8): _direct_256x8, (512, 8): _direct_512x8}


@njit(nogil=True, fastmath={"contract"})
def _weight_grad(xf, gf, offs, acc, n_, k_, ho, wo, sample, wp, bits, tper, xs, fill):
    # xf: the padded input, flat (sample: its elements per sample, wp: its row's length); gf:
    # the incoming gradient (N, K, Ho, Wo), flat; offs: each tap's offset in a sample. acc:
    # (K blocks of 4, tap blocks of tper, 4, tper, lanes) flat, added to: each lane's running
    # sum of g[n, k, p] * x[n, tap + p] over the positions p it sees, in sample, row, vector
    # order (a row's positions past its whole vectors: _weight_grad_rest). Blocks past K or
    # the taps repeat the last real one (their sums are dropped). The sums are loaded and
    # stored here, not through a function returning 16 vectors: that ran 1.7-2.5x slower.
    # fill (C, H, W, top, left, sh, sw), C > 0: xf is a workspace of a pass's samples padded
    # (split into their phases at a stride), zeros around them, filled here from the unpadded
    # input xs (Note [Padding as the kernels go]).
    lanes = bits // (8 * xf.itemsize)
    taps = offs.size
    kblocks = (k_ + 3) // 4
    tblocks = (taps + tper - 1) // tper
    plane = ho * wo
    vectors = wo // lanes
    per_pass = max(1, PASS_POSITIONS // plane)  # samples a block's sums stay in registers
    filled = fill[0]
    for n0 in range(0, n_, per_pass):
        first = 0  # where sample 0 is (would be) in xf
        if filled:
            first = -n0 * sample
            hq = sample // (filled * fill[5] * fill[6] * wp)
            for n in range(n0, min(n0 + per_pass, n_)):
                _fill(xs, xf, (n - n0) * sample, n, 0, filled, fill, hq, wp, bits)
        for kb in range(kblocks):
            for tb in range(tblocks):
                t = tb * tper
                a = ((kb * tblocks + tb) * 4 * tper) * lanes
                a1, a2, a3 = a + tper * lanes, a + 2 * tper * lanes, a + 3 * tper * lanes
                r00, r01 = vload(acc, a, bits), vload(acc, a + lanes, bits)
                r10, r11 = vload(acc, a1, bits), vload(acc, a1 + lanes, bits)
                r20, r21 = vload(acc, a2, bits), vload(acc, a2 + lanes, bits)
                r30, r31 = vload(acc, a3, bits), vload(acc, a3 + lanes, bits)
                r02 = r03 = r12 = r13 = r22 = r23 = r32 = r33 = r00
                if tper > 2:
                    r02, r03 = vload(acc, a + 2 * lanes, bits), vload(acc, a + 3 * lanes, bits)
                    r12, r13 = vload(acc, a1 + 2 * lanes, bits), vload(acc, a1 + 3 * lanes, bits)
                    r22, r23 = vload(acc, a2 + 2 * lanes, bits), vload(acc, a2 + 3 * lanes, bits)
                    r32, r33 = vload(acc, a3 + 2 * lanes, bits), vload(acc, a3 + 3 * lanes, bits)
                r04 = r05 = r14 = r15 = r24 = r25 = r34 = r35 = r00
                if tper > 4:
                    r04, r05 = vload(acc, a + 4 * lanes, bits), vload(acc, a + 5 * lanes, bits)
                    r14, r15 = vload(acc, a1 + 4 * lanes, bits), vload(acc, a1 + 5 * lanes, bits)
                    r24, r25 = vload(acc, a2 + 4 * lanes, bits), vload(acc, a2 + 5 * lanes, bits)
                    r34, r35 = vload(acc, a3 + 4 * lanes, bits), vload(acc, a3 + 5 * lanes, bits)
                for n in range(n0, min(n0 + per_pass, n_)):
                    g0 = (n * k_ + min(kb * 4, k_ - 1)) * plane
                    g1 = (n * k_ + min(kb * 4 + 1, k_ - 1)) * plane
                    g2 = (n * k_ + min(kb * 4 + 2, k_ - 1)) * plane
                    g3 = (n * k_ + min(kb * 4 + 3, k_ - 1)) * plane
                    x0 = first + n * sample + offs[min(t, taps - 1)]
                    x1 = first + n * sample + offs[min(t + 1, taps - 1)]
                    x2 = first + n * sample + offs[min(t + 2, taps - 1)]
                    x3 = first + n * sample + offs[min(t + 3, taps - 1)]
                    x4 = first + n * sample + offs[min(t + 4, taps - 1)]
                    x5 = first + n * sample + offs[min(t + 5, taps - 1)]
                    for y in range(ho):
                        for v in range(vectors):
                            p = y * wo + v * lanes
                            q = y * wp + v * lanes
                            G0, G1 = vload(gf, g0 + p, bits), vload(gf, g1 + p, bits)
                            G2, G3 = vload(gf, g2 + p, bits), vload(gf, g3 + p, bits)
                            X = vload(xf, x0 + q, bits)
                            r00, r10 = vfma(G0, X, r00), vfma(G1, X, r10)
                            r20, r30 = vfma(G2, X, r20), vfma(G3, X, r30)
                            X = vload(xf, x1 + q, bits)
                            r01, r11 = vfma(G0, X, r01), vfma(G1, X, r11)
                            r21, r31 = vfma(G2, X, r21), vfma(G3, X, r31)
                            if tper > 2:
                                X = vload(xf, x2 + q, bits)
                                r02, r12 = vfma(G0, X, r02), vfma(G1, X, r12)
                                r22, r32 = vfma(G2, X, r22), vfma(G3, X, r32)
                                X = vload(xf, x3 + q, bits)
                                r03, r13 = vfma(G0, X, r03), vfma(G1, X, r13)
                                r23, r33 = vfma(G2, X, r23), vfma(G3, X, r33)
                            if tper > 4:
                                X = vload(xf, x4 + q, bits)
                                r04, r14 = vfma(G0, X, r04), vfma(G1, X, r14)
                                r24, r34 = vfma(G2, X, r24), vfma(G3, X, r34)
                                X = vload(xf, x5 + q, bits)
                                r05, r15 = vfma(G0, X, r05), vfma(G1, X, r15)
                                r25, r35 = vfma(G2, X, r25), vfma(G3, X, r35)
                vstore(acc, a, r00)
                vstore(acc, a + lanes, r01)
                vstore(acc, a1, r10)
                vstore(acc, a1 + lanes, r11)
                vstore(acc, a2, r20)
                vstore(acc, a2 + lanes, r21)
                vstore(acc, a3, r30)
                vstore(acc, a3 + lanes, r31)
                if tper > 2:
                    vstore(acc, a + 2 * lanes, r02)
                    vstore(acc, a + 3 * lanes, r03)
                    vstore(acc, a1 + 2 * lanes, r12)
                    vstore(acc, a1 + 3 * lanes, r13)
                    vstore(acc, a2 + 2 * lanes, r22)
                    vstore(acc, a2 + 3 * lanes, r23)
                    vstore(acc, a3 + 2 * lanes, r32)
                    vstore(acc, a3 + 3 * lanes, r33)
                if tper > 4:
                    vstore(acc, a + 4 * lanes, r04)
                    vstore(acc, a + 5 * lanes, r05)
                    vstore(acc, a1 + 4 * lanes, r14)
                    vstore(acc, a1 + 5 * lanes, r15)
                    vstore(acc, a2 + 4 * lanes, r24)
                    vstore(acc, a2 + 5 * lanes, r25)
                    vstore(acc, a3 + 4 * lanes, r34)
                    vstore(acc, a3 + 5 * lanes, r35)


@njit(cache=True, nogil=True)
def _weight_grad_rest(xf, gf, offs, rest, n_, k_, ho, wo, sample, wp, first):
    """Each weight's sum over the positions of a row from ``first`` on (past its whole
    vectors), one at a time, into ``rest`` (K, taps)."""
    taps = offs.size
    plane = ho * wo
    for n in range(n_):
        for k in range(k_):
            g = (n * k_ + k) * plane
            for t in range(taps):
                x = n * sample + offs[t]
                total = rest[k, t]
                for y in range(ho):
                    for p in range(first, wo):
                        total += gf[g + y * wo + p] * xf[x + y * wp + p]
                rest[k, t] = total


@njit(cache=True, nogil=True, fastmath={"contract"})
def _weight_grad_256x2(xf, gf, offs, acc, n_, k_, ho, wo, sample, wp, xs, fill):
    _weight_grad(xf, gf, offs, acc, n_, k_, ho, wo, sample, wp, 256, 2, xs, fill)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _weight_grad_512x6(xf, gf, offs, acc, n_, k_, ho, wo, sample, wp, xs, fill):
    _weight_grad(xf, gf, offs, acc, n_, k_, ho, wo, sample, wp, 512, 6, xs, fill)


# (vector bits, taps per block; 4 outputs each): the weight gradient's kernel for them
WEIGHT_GRAD_KERNELS = {(256, 2): _weight_grad_256x2, (512, 6): _weight_grad_512x6}
WEIGHT_GRAD_TAPS = {256: 2, 512: 6}  # taps a block, by vector width


# AVX-512: 512-bit vectors and 32 vector registers, room for 8 x 2 accumulators
WIDTHS = (512, 256) if AVX512 else (256,)  # the vector widths worth using here, widest first
OUTPUTS = 8 if AVX512 else 4  # output channels per block: 8 x 2 accumulators spill in 16 registers



def whole_rows(wo, dtype, bits=None, ho=None):
    """Whether rows of ``wo`` output positions (``ho`` of them, where known) take no scalar loop
    at vectors of ``bits`` (None: at one of this CPU's ``WIDTHS``): whole blocks (at 256 bits,
    multiples of 16 float32 or 8 float64 positions), one vector (8 float32 or 4 float64: two
    rows a block), or at 512 bits half a vector with ``ho`` a multiple of 4 (four rows a
    block, each vector two rows: 8x8 float32 planes)."""
    if bits is None:
        return any(whole_rows(wo, dtype, width, ho) for width in WIDTHS)
    lanes = bits // (8 * np.dtype(dtype).itemsize)
    halves = HALF_ROWS and bits == 512 and 2 * wo == lanes and ho is not None and ho % 4 == 0
    return wo % (BLOCK_VECTORS * lanes) == 0 or wo == lanes or halves


def width_for(wo, dtype, ho=None):
    """The widest of this CPU's vector widths (``WIDTHS``) whose blocks take rows of ``wo``
    whole (``whole_rows``); the narrowest where none does."""
    for bits in WIDTHS:
        if whole_rows(wo, dtype, bits, ho):
            return bits
    return WIDTHS[-1]


def takes(x, w):
    """Whether ``conv2d_stride1`` takes these arrays: C-contiguous numpy float32/float64 of one
    dtype, x 4-D and w 4-D."""
    return (type(x) is np.ndarray and type(w) is np.ndarray and x.dtype == w.dtype
            and x.dtype in (np.float32, np.float64) and x.ndim == 4 and w.ndim == 4
            and x.flags.c_contiguous)


def conv2d_stride1(x, w, dilation=(1, 1), out=None, bits=None, per=None, padding=None):
    """The stride-1 convolution (groups 1, no bias) of the zero-padded input x (N, C, Hp, Wp)
    with w (K, C, kh, kw): (N, K, Ho, Wo), into ``out`` (a C-contiguous array of that shape and
    x's dtype) when given, by the kernel of ``KERNELS[bits, per]`` (by default ``width_for``
    the rows, and this CPU's ``OUTPUTS``): every one gives the same sums, bit for bit.
    ``padding`` (top, bottom, left, right): x is the input before its padding, padded a chunk
    of channels at a time as the kernel goes (Note [Padding as the kernels go]), the same sums
    as over its padded copy. ``takes(x, w)`` must hold."""
    n, c, hp, wp = x.shape
    if padding is not None:
        hp, wp = hp + padding[0] + padding[1], wp + padding[2] + padding[3]
    k, kh, kw = _check_weight("conv2d_stride1", x, w)
    dh, dw = dilation
    ho, wo = hp - dh * (kh - 1), wp - dw * (kw - 1)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"conv2d_stride1: the padded input {hp}x{wp} is smaller than the "
                         f"dilated kernel {dh * (kh - 1) + 1}x{dw * (kw - 1) + 1}")
    return _convolve(x.reshape(-1), w, _tap_offsets(c, kh, kw, hp, wp, dilation), c * hp * wp,
                     wp, (n, k, ho, wo), out, bits, per,
                     fill=None if padding is None else (x, padding[0], padding[2], 1, 1))


def conv2d_strided(x, w, stride, padding, dilation=(1, 1), bits=None, per=None, whole=False):
    """The convolution (groups 1, no bias) of x (N, C, H, W), zero-padded by padding (top,
    bottom, left, right), with w (K, C, kh, kw) at ``stride`` (sh, sw): (N, K, Ho, Wo).

    The padded input is split into its sh*sw phases, phase (p, q) holding the positions
    (sh*y + p, sw*x + q), so that each tap reads a run of one phase's row: the stride-1 kernel
    with each tap's offset into its phase (one more copy of the input, in place of the columns'
    kh*kw), a sample's chunk of channels at a time in a small workspace as the kernel goes
    (Note [Padding as the kernels go]; ``whole``: the whole input's phases first, the
    reference). The same sums as ``conv2d_stride1`` over the same taps, in the same order."""
    k, kh, kw = _check_weight("conv2d_strided", x, w)
    (hq, wq), offs, (ho, wo) = _phase_geometry("conv2d_strided", x.shape, (kh, kw), stride,
                                               padding, dilation)
    n, c = x.shape[:2]
    sample = c * stride[0] * stride[1] * hq * wq
    if whole:
        phases = _phases(x, stride, padding, (hq, wq))
        return _convolve(phases.reshape(-1), w, offs, sample, wq, (n, k, ho, wo), None, bits,
                         per, STRIDED_CHUNK)
    return _convolve(np.ascontiguousarray(x).reshape(-1), w, offs, sample, wq, (n, k, ho, wo),
                     None, bits, per, STRIDED_CHUNK,
                     fill=(x, padding[0], padding[2], stride[0], stride[1]))


def _phase_geometry(name, shape, kernel_size, stride, padding, dilation):
    """For x of ``shape`` (N, C, H, W) zero-padded by padding and split into its stride's
    phases (``_phases``): a phase's (Hq, Wq); each tap's offset into its phase in a sample
    (int64, taps in (channel, row, column) order, shared: the kernels only read it); the
    output's (Ho, Wo). Each tap then reads a run of one phase's row, as a stride-1 kernel
    does."""
    return _phase_geometry_of(name, tuple(shape), tuple(kernel_size), tuple(stride),
                              tuple(padding), tuple(dilation))


@functools.lru_cache(maxsize=256)
def _phase_geometry_of(name, shape, kernel_size, stride, padding, dilation):
    # (kept per shape, as _tap_offsets: 20-30 us a call, two calls a strided layer a step)
    n, c, height, width = shape
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    top, bottom, left, right = padding
    hp, wp = height + top + bottom, width + left + right
    ho, wo = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"{name}: the padded input {hp}x{wp} is smaller than the "
                         f"dilated kernel {dh * (kh - 1) + 1}x{dw * (kw - 1) + 1}")
    hq, wq = -(-hp // sh), -(-wp // sw)
    ci, i, j = _tap_grid(c, kh, kw)
    phase = (ci * sh + (i * dh) % sh) * sw + (j * dw) % sw
    offs = (phase * (hq * wq) + ((i * dh) // sh) * wq + (j * dw) // sw).reshape(-1)
    return (hq, wq), offs.astype(np.int64), (ho, wo)


def _phases(x, stride, padding, phase_size):
    """x (N, C, H, W) zero-padded by padding and split into its stride's phases of
    ``phase_size`` (Hq, Wq): (N, C, sh, sw, Hq, Wq), phase (p, q) holding the padded positions
    (sh*y + p, sw*x + q)."""
    phases = np.empty(x.shape[:2] + tuple(stride) + tuple(phase_size), x.dtype)
    _split_phases(np.ascontiguousarray(x), phases, padding[0], padding[2])
    return phases


def _split_phases(x, phases, top, left):
    """phases[n, c, p, q, y, z] = x[n, c, sh*y + p - top, sw*z + q - left], 0 outside x: every
    element written (C-contiguous numpy arrays of one dtype). numpy's strided slices took 1.7
    ms for ResNet-18's 16 channels of 32x32 at batch 32 (the stride-2 forward's third)."""
    bits = 512 if AVX512 else 256
    (_split_phases_512 if bits == 512 else _split_phases_256)(
        x.reshape(-1), x.shape, phases.reshape(-1), phases.shape, top, left)


@njit(nogil=True, inline="always")
def _split_plane(xf, src, pf, d, height, width, sh, sw, hq, wq, top, left, bits, zeros):
    # One plane (at src in xf, height x width) into its sh*sw phases at d in pf, each
    # destination row in order: the source row's run at stride sw, zeros around it (unless
    # ``zeros`` is False: pf has them there already). At sw 1 and 2 whole vectors of it (vload,
    # vload_even, where the vectors read lie inside xf); else one element at a time. Returns
    # where the next plane's phases go.
    lanes = bits // (8 * xf.itemsize)
    for p in range(sh):
        for q in range(sw):
            lo = min(wq, max(0, -(-(left - q) // sw)))  # the row's run: [lo, hi)
            hi = max(lo, min(wq, (width - 1 - q + left) // sw + 1))
            for y in range(hq):
                r = sh * y + p - top
                if r < 0 or r >= height:
                    if zeros:
                        for z in range(wq):
                            pf[d + z] = 0
                    d += wq
                    continue
                if zeros:
                    for z in range(lo):
                        pf[d + z] = 0
                s0 = src + r * width + q - left
                z = lo
                if sw == 2:
                    while z + lanes <= hi and s0 + 2 * (z + lanes) <= xf.size:
                        vstore(pf, d + z, vload_even(xf, s0 + 2 * z, bits))
                        z += lanes
                elif sw == 1:
                    while z + lanes <= hi:
                        vstore(pf, d + z, vload(xf, s0 + z, bits))
                        z += lanes
                for z in range(z, hi):
                    pf[d + z] = sload(xf, s0 + sw * z)
                if zeros:
                    for z in range(hi, wq):
                        pf[d + z] = 0
                d += wq
    return d


@njit(nogil=True, inline="always")
def _split(xf, shape, pf, phase_shape, top, left, bits):
    # Every plane of xf (shape) into its phases in pf (phase_shape), zeros included.
    n_, c_, height, width = shape
    sh, sw, hq, wq = phase_shape[2:]
    d = 0
    for nc in range(n_ * c_):
        d = _split_plane(xf, nc * height * width, pf, d, height, width, sh, sw, hq, wq, top,
                         left, bits, True)


@njit(cache=True, nogil=True)
def _split_phases_512(xf, shape, pf, phase_shape, top, left):
    _split(xf, shape, pf, phase_shape, top, left, 512)


@njit(cache=True, nogil=True)
def _split_phases_256(xf, shape, pf, phase_shape, top, left):
    _split(xf, shape, pf, phase_shape, top, left, 256)


def _check_weight(name, x, w):
    """(K, kh, kw) of w, whose input channels must be x's."""
    k, cw, kh, kw = w.shape
    if cw != x.shape[1]:
        raise ValueError(f"{name}: weight {list(w.shape)} has {cw} input channels, the "
                         f"input {list(x.shape)} has {x.shape[1]}; groups are not supported here")
    return k, kh, kw


def _convolve(xf, w, offs, sample, row, shape, out, bits, per, chunk_channels=CHUNK_CHANNELS,
              fill=None):
    """Run the kernel over the flat input ``xf`` (``sample`` elements a sample, rows ``row``
    long), each tap at its offset ``offs``, into ``out`` of ``shape`` (N, K, Ho, Wo). ``fill``
    (x, top, left, sh, sw): xf is x (N, C, H, W) unpadded, its padded planes (their phases at
    a stride) made a chunk of channels at a time in a workspace (Note [Padding as the kernels
    go])."""
    n, k, ho, wo = shape
    if out is None:
        out = np.empty(shape, w.dtype)
    if out.size == 0:
        return out
    bits = width_for(wo, w.dtype, ho) if bits is None else bits
    per = OUTPUTS if per is None else per
    kernel = KERNELS.get((bits, per))
    if kernel is None:
        raise ValueError(f"direct convolution: no kernel for {bits}-bit vectors and {per} "
                         f"outputs a block; bits and per must be one of {sorted(KERNELS)}")
    blocks = -(-k // per)
    packed = np.zeros((blocks * per, offs.size), w.dtype)
    packed[:k] = w.reshape(k, -1)
    # (blocks, taps, per): each tap's weights of a block's outputs side by side
    packed = np.ascontiguousarray(packed.reshape(blocks, per, -1).transpose(0, 2, 1)).reshape(-1)
    chunk = chunk_channels * w.shape[2] * w.shape[3]
    if fill is None:
        kernel(xf, packed, offs, out, sample, row, chunk, w.dtype.type(0), xf, _NO_FILL)
        return out
    c = fill[0].shape[1]
    space = np.zeros(min(c, chunk_channels) * (sample // c), w.dtype)  # its zeros stay
    kernel(space, packed, offs, out, sample, row, chunk, w.dtype.type(0), xf, _kernel_fill(fill))
    return out


def _kernel_fill(fill):
    """The kernels' ``fill`` tuple (C, H, W, top, left, sh, sw) from (x, top, left, sh, sw)."""
    x, top, left, sh, sw = fill
    return x.shape[1:] + (top, left, sh, sw)


_NO_FILL = (0,) * 7  # the kernels' ``fill`` where they read a padded input whole


@functools.lru_cache(maxsize=256)
def _tap_offsets(c, kh, kw, hp, wp, dilation):
    """Each tap's (input channel, kernel row, kernel column) offset in a padded sample (kept
    per shape: 25 us a call, three calls a layer a step; the kernels only read it)."""
    dh, dw = dilation
    ci, i, j = _tap_grid(c, kh, kw)
    return (ci * (hp * wp) + i * (dh * wp) + j * dw).reshape(-1)


def _tap_grid(c, kh, kw):
    """Each tap's (input channel, kernel row, kernel column) as int64 arrays that broadcast to
    (c, kh, kw): meshgrid's values without its copies (np.meshgrid took 45 us a call, 2-4 ms
    of a ResNet-18 step in the direct kernels' calls)."""
    return (np.arange(c, dtype=np.int64).reshape(c, 1, 1),
            np.arange(kh, dtype=np.int64).reshape(1, kh, 1),
            np.arange(kw, dtype=np.int64).reshape(1, 1, kw))


def weight_grad_bits(wo, dtype):
    """The widest of this CPU's vector widths (``WIDTHS``) of which rows of ``wo`` positions
    are whole vectors (512 bits where ``wo`` is a multiple of 16 float32 positions), or None."""
    for bits in WIDTHS:
        if wo % (bits // (8 * np.dtype(dtype).itemsize)) == 0:
            return bits
    return None


def weight_grad_stride1(x, g, kernel_size, dilation=(1, 1), bits=None, padding=None):
    """The weight's gradient (K, C, kh, kw) of the stride-1 convolution (groups 1) of the
    zero-padded input x (N, C, Hp, Wp) whose output's gradient is g (N, K, Ho, Wo), both
    C-contiguous numpy arrays of one float dtype: each lane of a vector sums its positions'
    products in registers (4 outputs x 6 taps at 512 bits, x 2 at 256), the lanes summed at the
    end; positions past a row's whole vectors one at a time (slow: nn/_conv.py sends rows of
    whole vectors only). ``bits``: 256 or 512 (default: ``weight_grad_bits``, else 256).
    ``padding`` (top, bottom, left, right): x is the input before its padding, padded a pass of
    samples at a time as the kernel goes (Note [Padding as the kernels go]): the same sums."""
    n, c, hp, wp = x.shape
    fill = None
    if padding is not None:
        fill = (x, padding[0], padding[2], 1, 1)
        hp, wp = hp + padding[0] + padding[1], wp + padding[2] + padding[3]
    gn, k, ho, wo = g.shape
    kh, kw = kernel_size
    dh, dw = dilation
    if gn != n or (ho, wo) != (hp - dh * (kh - 1), wp - dw * (kw - 1)):
        raise ValueError(f"weight_grad_stride1: a gradient {list(g.shape)} is not the output "
                         f"of a {kh}x{kw} kernel (dilation {dh}, {dw}) over {list(x.shape)}")
    offs = _tap_offsets(c, kh, kw, hp, wp, dilation)
    return _weight_grad_sums(x.reshape(-1), g, offs, c * hp * wp, wp, (c, kh, kw), bits,
                             "weight_grad_stride1", fill)


def weight_grad_strided(x, g, kernel_size, stride, padding, dilation=(1, 1), bits=None,
                        whole=False):
    """The weight's gradient (K, C, kh, kw) of the convolution (groups 1) of x (N, C, H, W),
    zero-padded by padding (top, bottom, left, right), at ``stride``, whose output's gradient
    is g (N, K, Ho, Wo): ``weight_grad_stride1``'s kernel over the input's phases (as
    ``conv2d_strided``, ``whole`` too), each tap reading a run of its phase's rows. The same
    terms in the same order as the stride-1 kernel over a strided view would sum."""
    n, c = x.shape[:2]
    (kh, kw) = kernel_size
    (hq, wq), offs, (ho, wo) = _phase_geometry("weight_grad_strided", x.shape, kernel_size,
                                               stride, padding, dilation)
    if g.ndim != 4 or g.shape != (x.shape[0], g.shape[1], ho, wo):
        raise ValueError(f"weight_grad_strided: a gradient {list(g.shape)} is not the output "
                         f"of a {kh}x{kw} kernel at stride {tuple(stride)}, padding "
                         f"{tuple(padding)}, dilation {tuple(dilation)} over {list(x.shape)}")
    sample = c * stride[0] * stride[1] * hq * wq
    if whole:
        return _weight_grad_sums(_phases(x, stride, padding, (hq, wq)).reshape(-1), g, offs,
                                 sample, wq, (c, kh, kw), bits, "weight_grad_strided")
    return _weight_grad_sums(np.ascontiguousarray(x).reshape(-1), g, offs, sample, wq,
                             (c, kh, kw), bits, "weight_grad_strided",
                             (x, padding[0], padding[2], stride[0], stride[1]))


def _weight_grad_sums(xf, g, offs, sample, row, kernel, bits, name, fill=None):
    """The weight gradient's kernel over the flat input ``xf`` (``sample`` elements a sample,
    rows ``row`` long, each tap at its offset ``offs``) and g (N, K, Ho, Wo): (K, C, kh, kw).
    ``fill`` (x, top, left, sh, sw): xf is x (N, C, H, W) unpadded, a pass's samples padded
    (their phases at a stride) in a workspace as the kernel goes (Note [Padding as the kernels
    go])."""
    n, k, ho, wo = g.shape
    c, kh, kw = kernel
    if bits is None:
        bits = weight_grad_bits(wo, xf.dtype) or 256
    tper = WEIGHT_GRAD_TAPS.get(bits)
    if tper is None:
        raise ValueError(f"{name}: bits must be 256 or 512, not {bits!r}")
    lanes = bits // (8 * xf.itemsize)
    taps = c * kh * kw
    kblocks, tblocks = -(-k // 4), -(-taps // tper)
    first = wo - wo % lanes
    if fill is not None and first < wo:  # the scalar loop reads the padded input whole
        x, top, left, sh, sw = fill
        padding = (top, 0, left, 0)  # (only the top and left ones are read)
        xf = _phases(x, (sh, sw), padding, (sample // (c * sh * sw * row), row)).reshape(-1)
        fill = None
    acc = np.zeros(kblocks * tblocks * 4 * tper * lanes, xf.dtype)
    if n and k and taps:
        space, xs, how = xf, xf, _NO_FILL
        if fill is not None:
            per_pass = max(1, PASS_POSITIONS // (ho * wo))  # as the kernel's passes
            space = np.zeros(min(n, per_pass) * sample, xf.dtype)  # its zeros stay
            how = _kernel_fill(fill)
        WEIGHT_GRAD_KERNELS[bits, tper](space, g.reshape(-1), offs, acc, n, k, ho, wo, sample,
                                        row, xs, how)
    sums = np.empty((k, taps), xf.dtype)
    _lane_sums(acc.reshape(kblocks, tblocks, 4, tper, lanes), sums)
    if first < wo and n and k and taps:
        _weight_grad_rest(xf, g.reshape(-1), offs, sums, n, k, ho, wo, sample, row, first)
    return sums.reshape(k, c, kh, kw)


@njit(cache=True, nogil=True)
def _lane_sums(acc, sums):
    """sums (K, taps) = each weight's lanes summed, in lane order: acc is (K blocks of 4, tap
    blocks, 4, taps a block, lanes). (numpy's sum over the lanes and the transposed copy out
    took 0.4 ms at 32 channels of 16x16, 8% of the weight gradient.)"""
    k_, taps = sums.shape
    kblocks, tblocks, outs, tper, lanes = acc.shape
    for kb in range(kblocks):
        for o in range(outs):
            k = kb * outs + o
            if k >= k_:
                break
            for tb in range(tblocks):
                for t in range(tper):
                    tap = tb * tper + t
                    if tap >= taps:
                        break
                    total = acc[kb, tb, o, t, 0]
                    for lane in range(1, lanes):
                        total += acc[kb, tb, o, t, lane]
                    sums[k, tap] = total
