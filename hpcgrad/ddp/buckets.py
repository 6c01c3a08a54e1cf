"""Group parameters into gradient buckets by size, per dtype and device (as reducer.cpp does)."""

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor

DEFAULT_FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early


def compute_bucket_assignment_by_size(tensors, bucket_size_limits, expect_sparse_gradient=None,
                                      tensor_indices=None):
    """Lists of tensor indices, one per bucket (``tensors``: hpcgrad Tensors or arrays).

    Tensors of one (dtype, device) fill a bucket until it reaches the current size limit; the
    limits are taken in turn per key (the last one repeats). A tensor expecting a sparse
    gradient gets a bucket of its own. Without ``tensor_indices`` the buckets are sorted by
    their smallest index; with them (indices in gradient-ready order) the order is kept.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("compute_bucket_assignment_by_size: no tensors given")
    if not bucket_size_limits:
        raise ValueError("compute_bucket_assignment_by_size: bucket_size_limits is empty")
    if expect_sparse_gradient is not None and len(expect_sparse_gradient) != len(tensors):
        raise ValueError(f"expect_sparse_gradient has {len(expect_sparse_gradient)} entries for "
                         f"{len(tensors)} tensors")
    if tensor_indices is not None and len(tensor_indices) != len(tensors):
        raise ValueError(f"tensor_indices has {len(tensor_indices)} entries for "
                         f"{len(tensors)} tensors")
    result = []
    open_buckets = {}  # key -> [indices, bytes]
    limit_position = {}
    for i, tensor in enumerate(tensors):
        index = i if tensor_indices is None else tensor_indices[i]
        if expect_sparse_gradient is not None and expect_sparse_gradient[index]:
            result.append([index])
            continue
        if getattr(tensor, "is_sparse", False):
            raise ValueError(f"compute_bucket_assignment_by_size: tensor {index} is sparse; "
                             "buckets hold dense tensors (mark it in expect_sparse_gradient)")
        data = tensor.array if isinstance(tensor, Tensor) else tensor
        key = (data.dtype, backend.device_of(data))
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(index)
        bucket[1] += data.size * data.dtype.itemsize
        position = limit_position.setdefault(key, 0)
        if bucket[1] >= bucket_size_limits[position]:
            result.append(bucket[0])
            open_buckets[key] = [[], 0]
            limit_position[key] = min(position + 1, len(bucket_size_limits) - 1)
    result.extend(b[0] for b in open_buckets.values() if b[0])
    if tensor_indices is None:
        result.sort(key=min)
    return result
