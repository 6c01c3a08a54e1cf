"""Calling MKL's JIT-compiled products from numba loops (Note [MKL's JIT products])."""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def call(typingctx, kernel, jitter, a, b, c):
    """``kernel(jitter, a, b, c)``: the product base/blas.py ``jit_product`` made, at address
    ``kernel``, on the matrices at addresses ``a``, ``b`` and ``c`` (integers, as
    ``array.ctypes.data`` plus byte offsets)."""
    if not all(isinstance(x, types.Integer) for x in (kernel, jitter, a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        pointer = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [pointer] * 4)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fn, [builder.inttoptr(x, pointer) for x in args[1:]])
        return context.get_dummy_value()
    return types.void(kernel, jitter, a, b, c), codegen
