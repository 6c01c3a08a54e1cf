"""``torch.utils``: its submodules (checkpoint, data, tensorboard) are aliases of the modules that
build them (Note [Import paths] in hpcgrad/_paths.py)."""

from hpcgrad import data  # noqa: F401  (hpcgrad.utils.data after import hpcgrad)
