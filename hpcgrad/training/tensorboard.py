"""torch.utils.tensorboard.SummaryWriter for hpcgrad: tensorboardX's writer, taking hpcgrad Tensors.

PyTorch's own writer came from tensorboardX and keeps its methods and signatures; this one is
tensorboardX's (a maintained library that needs neither torch nor TensorFlow: ``pip install -e
".[tensorboard]"``), with hpcgrad Tensors and cupy arrays brought to host numpy arrays where
tensorboardX would refuse them. ``tensorboard --logdir DIR`` shows what it writes; the jobs
write their metrics through it beside metrics.jsonl (hpcgrad/training/metrics.py).
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor

try:
    from tensorboardX import SummaryWriter as _TensorboardXWriter
except ImportError as error:  # PyTorch's module raises ImportError the same way
    raise ImportError("hpcgrad.utils.tensorboard needs tensorboardX: pip install -e "
                      "'.[tensorboard]' (or pip install tensorboardX)") from error

__all__ = ["SummaryWriter"]


def _host(value):
    """An hpcgrad Tensor or a cupy array as a host numpy array (a scalar as a Python float);
    anything else as it is."""
    if isinstance(value, Tensor):
        value = value.detach().array
    if backend.is_gpu_array(value):
        value = backend.to_device(value, backend.CPU)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value


class SummaryWriter(_TensorboardXWriter):
    """``SummaryWriter(log_dir=None, comment='', purge_step=None, max_queue=10,
    flush_secs=120, filename_suffix='')``: PyTorch's signature and methods; values may be
    hpcgrad Tensors."""

    def __init__(self, log_dir=None, comment="", purge_step=None, max_queue=10, flush_secs=120,
                 filename_suffix=""):
        super().__init__(logdir=log_dir, comment=comment, purge_step=purge_step,
                         max_queue=max_queue, flush_secs=flush_secs,
                         filename_suffix=filename_suffix)

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None, **kwargs):
        return super().add_scalar(tag, _host(scalar_value), global_step, walltime, **kwargs)

    def add_scalars(self, main_tag, tag_scalar_dict, global_step=None, walltime=None):
        values = {tag: _host(value) for tag, value in tag_scalar_dict.items()}
        return super().add_scalars(main_tag, values, global_step, walltime)

    def add_histogram(self, tag, values, global_step=None, bins="tensorflow", walltime=None,
                      max_bins=None):
        return super().add_histogram(tag, np.asarray(_host(values)), global_step, bins,
                                     walltime, max_bins)

    def add_image(self, tag, img_tensor, global_step=None, walltime=None, dataformats="CHW"):
        return super().add_image(tag, np.asarray(_host(img_tensor)), global_step, walltime,
                                 dataformats)

    def add_images(self, tag, img_tensor, global_step=None, walltime=None, dataformats="NCHW"):
        return super().add_images(tag, np.asarray(_host(img_tensor)), global_step, walltime,
                                  dataformats)
