"""The training layer: one loop for every job (loop.py), its checkpoints, metrics, TensorBoard
and serialization, and ``torch.multiprocessing``'s spawn over MPI ranks.

Importing the package imports nothing: ``import hpcgrad`` reaches its checkpoint and
serialization modules, and the loop (which starts MPI) only loads when a job imports it.
"""
