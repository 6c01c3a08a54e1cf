"""Optimizers with PyTorch's names, options, update rules and state_dict layout."""

from hpcgrad.optim import lr_scheduler
from hpcgrad.optim.adadelta import Adadelta
from hpcgrad.optim.adagrad import Adagrad
from hpcgrad.optim.adam import Adam
from hpcgrad.optim.adamw import AdamW
from hpcgrad.optim.optimizer import Optimizer
from hpcgrad.optim.rmsprop import RMSprop
from hpcgrad.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Adadelta", "Adagrad", "RMSprop", "Optimizer", "lr_scheduler"]
