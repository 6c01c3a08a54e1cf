"""Data parallelism: DistributedDataParallel, its Reducer and bucket assignment (seed 004).

Users reach it as ``hpcgrad.nn.parallel.DistributedDataParallel``, PyTorch's name.
"""
