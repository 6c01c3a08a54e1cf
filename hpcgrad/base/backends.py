"""``torch.backends``: the flags scripts set (``cudnn.benchmark = True`` ...), accepted here.

hpcgrad has no cuDNN and no TF32 switch (cupy's matmuls follow cupy's own settings), so setting
these changes nothing; they exist so a script that sets them runs unchanged.
"""

import types

cudnn = types.SimpleNamespace(enabled=True, benchmark=False, deterministic=False,
                              allow_tf32=True, is_available=lambda: False)
cuda = types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False))
