"""Data parallelism: DistributedDataParallel, its Reducer and bucket assignment (as reducer.cpp).

Users reach it as ``hpcgrad.nn.parallel.DistributedDataParallel``, PyTorch's name.
"""
