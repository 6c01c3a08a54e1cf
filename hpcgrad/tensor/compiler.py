"""``hpcgrad.compile``: PyTorch's ``torch.compile`` signature, running the model eagerly.

``torch.compile`` traces a model into fused kernels; the result computes what the model
computes. hpcgrad has no graph compiler (its fused paths are chosen per op: Note [Where the
training step goes] in hpcgrad/nn/_functions.py), so it returns the model itself and a script
that compiles its model runs unchanged, with the same results, at eager speed.
"""

import functools


def compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None,
            options=None, disable=False):
    """``model`` itself (a Module or a function); without ``model``, a decorator doing so."""
    if model is None:
        return functools.partial(compile, fullgraph=fullgraph, dynamic=dynamic, backend=backend,
                                 mode=mode, options=options, disable=disable)
    if not callable(model):
        raise RuntimeError(f"compile: expected a Module or a function, got "
                           f"{type(model).__name__}")
    return model
