"""Vectors for numba kernels: an LLVM vector type and intrinsics to load, store and combine it.

Numba has no vector type, and LLVM keeps a value in a register only when it is one: these give
numba kernels one (``Vec``, an LLVM <8 x float> or <16 x float> ...), so a kernel can say which
values are vectors and where they are loaded and stored (Note [Direct convolution], Note
[Winograd convolution]). A kernel passes the width in bits as a constant (256 or 512): a 512-bit
vector on a CPU without AVX-512 runs as two halves, so the same code is correct on any CPU.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, models, register_model


class Vec(types.Type):
    """A 256- or 512-bit vector of float32 or float64 lanes, as one LLVM value (a register)."""

    def __init__(self, dtype, bits):
        self.dtype = dtype
        self.lanes = bits // dtype.bitwidth
        super().__init__(name=f"Vec({dtype} x {self.lanes})")


def _bits(bits):
    """A vector's width in bits from an intrinsic's ``bits`` argument when it is a literal 256 or
    512 (the entry points below pass a constant, so the width is known when numba compiles);
    else None, which tells numba this typing does not apply (it tries the literal one too)."""
    if isinstance(bits, types.IntegerLiteral) and bits.literal_value in (256, 512):
        return bits.literal_value
    return None


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        lane = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(lane, fe_type.lanes))


def _element_pointer(context, builder, arytype, ary, index):
    data = context.make_array(arytype)(context, builder, ary).data
    return builder.gep(data, [index])


@intrinsic
def vload(typingctx, arr, index, bits):
    """The vector at arr[index:index + lanes] (1-D contiguous ``arr``; unaligned, unchecked)."""
    if _bits(bits) is None:
        return None
    vec = Vec(arr.dtype, _bits(bits))

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        ptr = builder.bitcast(ptr, context.get_value_type(vec).as_pointer())
        return builder.load(ptr, align=1)
    return vec(arr, index, bits), codegen


@intrinsic
def vload_rows(typingctx, arr, first, step, parts, bits):
    """A vector made of ``parts`` (a constant 2 or 4) pieces of lanes/parts elements, piece r
    from arr[first + r*step:]: rows shorter than a vector, two or four of them a vector
    (unaligned, unchecked). Four rows of a quarter (4x4 planes, two samples a block) ran at 50
    GF/s, slower than the columns' 63-131 GF/s at 128-512 channels: only halves are used."""
    if _bits(bits) is None or not isinstance(parts, types.IntegerLiteral) \
            or parts.literal_value not in (2, 4):
        return None
    vec = Vec(arr.dtype, _bits(bits))
    count = parts.literal_value

    def codegen(context, builder, sig, args):
        piece = ir.VectorType(context.get_value_type(vec).element, vec.lanes // count)
        pieces = []
        for r in range(count):
            at = builder.add(args[1], builder.mul(args[2], ir.Constant(args[2].type, r)))
            pointer = _element_pointer(context, builder, sig.args[0], args[0], at)
            pieces.append(builder.load(builder.bitcast(pointer, piece.as_pointer()), align=1))
        while len(pieces) > 1:  # join neighbours: 4 quarters -> 2 halves -> 1 vector
            width = 2 * pieces[0].type.count
            mask = ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(width)))
            pieces = [builder.shuffle_vector(pieces[i], pieces[i + 1], mask)
                      for i in range(0, len(pieces), 2)]
        return pieces[0]
    return vec(arr, first, step, parts, bits), codegen


@intrinsic
def sload(typingctx, arr, index):
    """arr[index], one element, unchecked: numba's own indexing first turns a negative index
    into one from the end (a shift, an and and an add each time), which in the direct
    convolution's tap loop (two scalar loads a tap) held its forward at 0.8x this one's speed
    (Note [Direct convolution])."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1]))
    return arr.dtype(arr, index), codegen


@intrinsic
def vload_even(typingctx, arr, index, bits):
    """The vector of arr[index], arr[index + 2], ..., arr[index + 2 * (lanes - 1)]: the two
    vectors from arr[index] loaded and their even lanes kept, one shuffle (unaligned,
    unchecked: reads 2 * lanes elements). LLVM's own vectorizing of a stride-2 copy gathers,
    at 1.8x numpy's time."""
    if _bits(bits) is None:
        return None
    vec = Vec(arr.dtype, _bits(bits))

    def codegen(context, builder, sig, args):
        vt = context.get_value_type(vec)
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        first = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=1)
        ptr = _element_pointer(context, builder, sig.args[0], args[0],
                               builder.add(args[1], ir.Constant(args[1].type, vec.lanes)))
        second = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=1)
        evens = ir.Constant(ir.VectorType(ir.IntType(32), vec.lanes),
                            list(range(0, 2 * vec.lanes, 2)))
        return builder.shuffle_vector(first, second, evens)
    return vec(arr, index, bits), codegen


@intrinsic
def vload_wide(typingctx, arr, index, bits):
    """The ``bits // 64`` elements at arr[index:] as a float64 vector of ``bits``: float32 ones
    widened, exactly (unaligned, unchecked). Sums of float32 arrays kept in float64 lanes
    (kernels/batchnorm.py)."""
    if _bits(bits) is None or arr.dtype not in (types.float32, types.float64):
        return None
    vec = Vec(types.float64, _bits(bits))

    def codegen(context, builder, sig, args):
        source = ir.VectorType(context.get_value_type(sig.args[0].dtype), vec.lanes)
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        value = builder.load(builder.bitcast(ptr, source.as_pointer()), align=1)
        if source.element != ir.DoubleType():
            value = builder.fpext(value, context.get_value_type(vec))
        return value
    return vec(arr, index, bits), codegen


@intrinsic
def vsum(typingctx, value):
    """The lanes of a vector summed in lane order: ((lane 0 + lane 1) + lane 2) + ..."""
    if not isinstance(value, Vec):
        return None

    def codegen(context, builder, sig, args):
        total = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for lane in range(1, sig.args[0].lanes):
            total = builder.fadd(total, builder.extract_element(
                args[0], ir.Constant(ir.IntType(32), lane)))
        return total
    return value.dtype(value), codegen


@intrinsic
def vstore(typingctx, arr, index, value):
    """arr[index:index + lanes] = value (unaligned, unchecked)."""
    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(ptr, args[2].type.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(arr, index, value), codegen


@intrinsic
def vsplat(typingctx, scalar, bits):
    """A vector of ``scalar`` in every lane."""
    if _bits(bits) is None:
        return None
    vec = Vec(scalar, _bits(bits))

    def codegen(context, builder, sig, args):
        vt = context.get_value_type(vec)
        lane0 = ir.Constant(ir.IntType(32), 0)
        one = builder.insert_element(ir.Constant(vt, ir.Undefined), args[0], lane0)
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), vec.lanes), [0] * vec.lanes)
        return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), zeros)
    return vec(scalar, bits), codegen


@intrinsic
def vfma(typingctx, w, x, acc):
    """w * x + acc, fused where the CPU can (LLVM's ``contract``)."""
    def codegen(context, builder, sig, args):
        product = builder.fmul(args[0], args[1], flags=("contract",))
        return builder.fadd(product, args[2], flags=("contract",))
    return acc(w, x, acc), codegen


def _elementwise(op):
    """An intrinsic applying IRBuilder's ``op`` to two vectors (or scalars) of one type."""
    @intrinsic
    def apply(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])
        return a(a, b), codegen
    return apply


vadd = _elementwise("fadd")
vsub = _elementwise("fsub")


@intrinsic
def vkeep_positive(typingctx, g, y):
    """g's lanes where y's are not <= 0 (greater, or NaN), 0 elsewhere: relu's backward
    (PyTorch's threshold_backward at 0) as a select, for a g and y of one vector type."""
    if not isinstance(g, Vec) or g != y:
        return None

    def codegen(context, builder, sig, args):
        zero = ir.Constant(args[0].type, None)
        return builder.select(builder.fcmp_unordered(">", args[1], zero), args[0], zero)
    return g(g, y), codegen


@intrinsic
def vneg(typingctx, a):
    """-a, lane by lane."""
    def codegen(context, builder, sig, args):
        return builder.fneg(args[0])
    return a(a), codegen


@intrinsic
def vtranspose(typingctx, src, src_at, src_offsets, dst, dst_at, dst_offsets, bits):
    """Transposes a square block: the ``lanes`` vectors at src[src_at + src_offsets[i]] (rows)
    become the vectors at dst[dst_at + dst_offsets[j]] (columns), through log2(lanes) rounds of
    interleaving shuffles in registers (a perfect shuffle of the rows' pairs each round:
    after log2(lanes) of them row j holds every row's element j). Offsets are int64 arrays of
    ``lanes``; unaligned, unchecked."""
    if _bits(bits) is None or src.dtype != dst.dtype:
        return None
    vec = Vec(src.dtype, _bits(bits))
    lanes = vec.lanes

    def codegen(context, builder, sig, args):
        src_ty, _, off_ty, dst_ty, _, doff_ty, _ = sig.args
        source, src_at, src_offsets, target, dst_at, dst_offsets, _ = args
        vt = context.get_value_type(vec)

        def offset(arytype, ary, i):
            pointer = _element_pointer(context, builder, arytype, ary,
                                       ir.Constant(ir.IntType(64), i))
            return builder.load(pointer)

        rows = []
        for i in range(lanes):
            at = builder.add(src_at, offset(off_ty, src_offsets, i))
            pointer = builder.bitcast(_element_pointer(context, builder, src_ty, source, at),
                                      vt.as_pointer())
            rows.append(builder.load(pointer, align=1))
        half = lanes // 2
        low = ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                          [x for k in range(half) for x in (k, k + lanes)])
        high = ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                           [x for k in range(half, lanes) for x in (k, k + lanes)])
        for _ in range(lanes.bit_length() - 1):
            shuffled = []
            for k in range(half):
                shuffled.append(builder.shuffle_vector(rows[k], rows[k + half], low))
                shuffled.append(builder.shuffle_vector(rows[k], rows[k + half], high))
            rows = shuffled
        for j in range(lanes):
            at = builder.add(dst_at, offset(doff_ty, dst_offsets, j))
            pointer = builder.bitcast(_element_pointer(context, builder, dst_ty, target, at),
                                      vt.as_pointer())
            builder.store(rows[j], pointer, align=1)
        return context.get_dummy_value()
    return types.void(src, src_at, src_offsets, dst, dst_at, dst_offsets, bits), codegen
