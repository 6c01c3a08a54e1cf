"""hpcgrad.nn: Module, Parameter, layers, losses, ``functional`` and ``init``, as in PyTorch."""

from hpcgrad.nn import functional, init, utils  # noqa: F401
from hpcgrad.nn.activation import (CELU, ELU, GELU, GLU, Hardsigmoid, Hardswish, Hardtanh,  # noqa: F401
                                   LeakyReLU, LogSigmoid, LogSoftmax, Mish, PReLU, ReLU, ReLU6,
                                   SELU, SiLU, Sigmoid, Softmax, Softplus, Softsign, Tanh,
                                   Tanhshrink, Threshold)
from hpcgrad.nn.batchnorm import BatchNorm1d, BatchNorm2d  # noqa: F401
from hpcgrad.nn.container import (ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential)  # noqa: F401
from hpcgrad.nn.conv import Conv1d, Conv2d  # noqa: F401
from hpcgrad.nn.distance import CosineSimilarity, PairwiseDistance  # noqa: F401
from hpcgrad.nn.dropout import Dropout  # noqa: F401
from hpcgrad.nn._dropout2d import Dropout2d  # noqa: F401
from hpcgrad.nn.embedding import Embedding  # noqa: F401
from hpcgrad.nn._embedding_bag import EmbeddingBag  # noqa: F401
from hpcgrad.nn.flatten import Flatten, Unflatten  # noqa: F401
from hpcgrad.nn.linear import Identity, Linear  # noqa: F401
from hpcgrad.nn.loss import (BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, KLDivLoss,  # noqa: F401
                             L1Loss, MarginRankingLoss, MSELoss, NLLLoss, SmoothL1Loss)
from hpcgrad.nn.module import Module  # noqa: F401
from hpcgrad.nn.normalization import LayerNorm  # noqa: F401
from hpcgrad.nn.parameter import Parameter  # noqa: F401
from hpcgrad.nn.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d  # noqa: F401
from hpcgrad.nn._multihead import MultiheadAttention  # noqa: F401
from hpcgrad.nn._transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer,  # noqa: F401
                                     TransformerEncoder, TransformerEncoderLayer)
from hpcgrad.nn._groupnorm import GroupNorm  # noqa: F401
from hpcgrad.nn._conv_transpose import ConvTranspose2d  # noqa: F401
from hpcgrad.nn._upsample import (PixelShuffle, PixelUnshuffle, Upsample, UpsamplingBilinear2d,  # noqa: F401
                                  UpsamplingNearest2d)
from hpcgrad.nn._pool_more import AdaptiveMaxPool2d, MaxPool1d  # noqa: F401
from hpcgrad.nn._padding import (CircularPad1d, CircularPad2d, CircularPad3d,  # noqa: F401
                                 ConstantPad1d, ConstantPad2d, ConstantPad3d, ReflectionPad1d,
                                 ReflectionPad2d, ReflectionPad3d, ReplicationPad1d,
                                 ReplicationPad2d, ReplicationPad3d, ZeroPad1d, ZeroPad2d,
                                 ZeroPad3d)
from hpcgrad.nn.rnn import GRU, GRUCell, LSTM, LSTMCell, RNN, RNNBase, RNNCell, RNNCellBase  # noqa: F401


def __getattr__(name):
    # SyncBatchNorm communicates, so it is built above hpcgrad.nn (hpcgrad/ddp/sync_batchnorm.py)
    # and re-exported by hpcgrad.nn.parallel; importing that here, on first use of the name,
    # keeps ``import hpcgrad.nn`` free of MPI (Note [Layers] in hpcgrad/__init__.py).
    if name == "SyncBatchNorm":
        from hpcgrad.nn.parallel import SyncBatchNorm
        return SyncBatchNorm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
