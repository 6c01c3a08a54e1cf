"""Argument checks shared by the CPU and CUDA kernel wrappers: a bad call raises, it never writes
out of bounds or into a temporary copy."""


def check_scaled_copy(dst, src):
    """``dst`` and ``src``: contiguous (``reshape(-1)`` of anything else is a copy) and equal sizes."""
    if dst.size != src.size:
        raise ValueError(f"scaled_copy: destination has {dst.size} elements, source {src.size}")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("scaled_copy: both arrays must be C-contiguous (the kernel works on a "
                         "flat view; of a strided array that would be a copy); pass "
                         "ascontiguousarray(src), and a contiguous destination")


def check_scaled_copy_multi(dst, sizes, offsets):
    """Offsets as ints: one per source, each ``[start, start + size)`` inside ``dst``, disjoint."""
    if not dst.flags.c_contiguous:
        raise ValueError("scaled_copy_multi: the destination must be C-contiguous (a flat bucket)")
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(sizes):
        raise ValueError(f"scaled_copy_multi: {len(sizes)} sources but {len(offsets)} offsets; "
                         "give one offset per source")
    end = None
    for start, size in sorted(zip(offsets, sizes)):
        if start < 0 or start + size > dst.size:
            raise ValueError(f"scaled_copy_multi: a source of {size} elements at offset {start} "
                             f"overruns the destination of {dst.size}")
        if end is not None and start < end and size:
            raise ValueError(f"scaled_copy_multi: the source at offset {start} overlaps the one "
                             f"ending at {end}; destinations must be disjoint")
        if size:
            end = start + size
    return offsets
