"""hpcgrad.nn: Module, Parameter, layers, losses, ``functional`` and ``init``, as in PyTorch."""

from . import functional, init, utils  # noqa: F401
from .activation import (CELU, ELU, GELU, GLU, Hardsigmoid, Hardswish,  # noqa: F401
                         Hardtanh, LeakyReLU, LogSigmoid, LogSoftmax, Mish, PReLU, ReLU, ReLU6,
                         SELU, SiLU, Sigmoid, Softmax, Softplus, Softsign, Tanh, Tanhshrink,
                         Threshold)
from .batchnorm import BatchNorm1d, BatchNorm2d  # noqa: F401
from .container import (ModuleDict, ModuleList, ParameterDict, ParameterList,  # noqa: F401
                        Sequential)
from .conv import Conv1d, Conv2d  # noqa: F401
from .distance import CosineSimilarity, PairwiseDistance  # noqa: F401
from .dropout import Dropout  # noqa: F401
from ._dropout2d import Dropout2d  # noqa: F401
from .embedding import Embedding  # noqa: F401
from ._embedding_bag import EmbeddingBag  # noqa: F401
from .flatten import Flatten, Unflatten  # noqa: F401
from .linear import Identity, Linear  # noqa: F401
from .loss import (BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, KLDivLoss,  # noqa: F401
                   L1Loss, MarginRankingLoss, MSELoss, NLLLoss, SmoothL1Loss)
from .module import Module  # noqa: F401
from .normalization import LayerNorm  # noqa: F401
from .parameter import Parameter  # noqa: F401
from .pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d  # noqa: F401
from ._multihead import MultiheadAttention  # noqa: F401
from ._transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer,  # noqa: F401
                           TransformerEncoder, TransformerEncoderLayer)
from ._groupnorm import GroupNorm  # noqa: F401
from ._conv_transpose import ConvTranspose2d  # noqa: F401
from ._upsample import (PixelShuffle, PixelUnshuffle, Upsample, UpsamplingBilinear2d,  # noqa: F401
                        UpsamplingNearest2d)
from ._pool_more import AdaptiveMaxPool2d, MaxPool1d  # noqa: F401
from .rnn import GRU, GRUCell, LSTM, LSTMCell, RNN, RNNBase, RNNCell, RNNCellBase  # noqa: F401


def __getattr__(name):
    # SyncBatchNorm communicates, so it is built above hpcgrad.nn (hpcgrad/ddp/sync_batchnorm.py)
    # and re-exported by hpcgrad.nn.parallel; importing that here, on first use of the name,
    # keeps ``import hpcgrad.nn`` free of MPI (Note [Layers] in hpcgrad/__init__.py).
    if name == "SyncBatchNorm":
        from .parallel import SyncBatchNorm
        return SyncBatchNorm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
