"""The communication layer: MPI start-up, buffers, Work handles, progress, timeouts; arrays only.

Nothing here knows a Tensor, autograd or a model: ``hpcgrad.distributed`` (PyTorch's names, on
Tensors) and the RPC agent build on it. Note [Layers] in hpcgrad/__init__.py.
"""
