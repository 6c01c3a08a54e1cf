"""Optimizers with PyTorch's names, options, update rules and state_dict layout."""

from . import lr_scheduler
from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam
from .adamw import AdamW
from .optimizer import Optimizer
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Adadelta", "Adagrad", "RMSprop", "Optimizer", "lr_scheduler"]
