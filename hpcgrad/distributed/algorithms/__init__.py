"""PyTorch's torch.distributed.algorithms import paths, over hpcgrad.distributed's modules."""
