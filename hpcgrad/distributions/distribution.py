"""Distribution: the base of hpcgrad.distributions (shapes, argument validation), as torch.distributions'."""

import warnings

import numpy as np

from hpcgrad.autograd import enable_grad
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.distributions import constraints

# Note [Validated distributions]
# As PyTorch, parameters are checked against ``arg_constraints`` when a distribution is built,
# and log_prob's value against ``support``, unless validation is off: per instance
# (``validate_args=False``) or for all (``Distribution.set_default_validate_args(False)``). The
# default is ``__debug__`` (on, unless Python runs with -O). A check reads the values, so on a
# GPU it synchronizes; turn it off where that costs.


class lazy_property:
    """Computed on first access (with grad enabled, so it joins the graph) and then cached on
    the instance, as torch.distributions.utils.lazy_property."""

    def __init__(self, wrapped):
        self.wrapped = wrapped
        self.__doc__ = wrapped.__doc__
        self.__name__ = wrapped.__name__

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        with enable_grad():
            value = self.wrapped(instance)
        setattr(instance, self.wrapped.__name__, value)
        return value


class Distribution:
    """A parameterized probability distribution (torch.distributions.Distribution)."""

    has_rsample = False
    has_enumerate_support = False
    _validate_args = __debug__

    @staticmethod
    def set_default_validate_args(value):
        """Turn argument validation on or off for every distribution without its own
        ``validate_args`` (Note [Validated distributions])."""
        if value not in [True, False]:
            raise ValueError(f"set_default_validate_args expects True or False, got {value!r}")
        Distribution._validate_args = value

    def __init__(self, batch_shape=(), event_shape=(), validate_args=None):
        self._batch_shape, self._event_shape = tuple(batch_shape), tuple(event_shape)
        if validate_args is not None:
            self._validate_args = validate_args
        if self._validate_args:
            try:
                arg_constraints = self.arg_constraints
            except NotImplementedError:
                arg_constraints = {}
                warnings.warn(f"{self.__class__} does not define `arg_constraints`. Please set "
                              "`arg_constraints = {}` or initialize the distribution with "
                              "`validate_args=False` to turn off validation.")
            for param, constraint in arg_constraints.items():
                if constraints.is_dependent(constraint):
                    continue
                if param not in self.__dict__ and isinstance(getattr(type(self), param),
                                                             lazy_property):
                    continue  # not given: computed from the one given, valid by construction
                value = getattr(self, param)
                if not np.all(constraint.check(value)):
                    raise ValueError(f"Expected parameter {param} ({type(value).__name__} of "
                                     f"shape {tuple(value.shape)}) of distribution {self!r} to "
                                     f"satisfy the constraint {constraint!r}, but found invalid "
                                     f"values:\n{value}")

    @property
    def batch_shape(self):
        return self._batch_shape

    @property
    def event_shape(self):
        return self._event_shape

    @property
    def arg_constraints(self):
        raise NotImplementedError

    @property
    def support(self):
        raise NotImplementedError

    @property
    def mean(self):
        raise NotImplementedError(f"{self.__class__} does not implement mean")

    @property
    def mode(self):
        raise NotImplementedError(f"{self.__class__} does not implement mode")

    @property
    def variance(self):
        raise NotImplementedError(f"{self.__class__} does not implement variance")

    @property
    def stddev(self):
        return self.variance.sqrt()

    def sample(self, sample_shape=()):
        raise NotImplementedError

    def rsample(self, sample_shape=()):
        raise NotImplementedError(f"{self.__class__} has no reparameterized sample (has_rsample "
                                  "is False): use sample(), or a score-function estimator")

    def sample_n(self, n):
        warnings.warn("sample_n will be deprecated. Use .sample((n,)) instead", UserWarning)
        return self.sample((n,))

    def log_prob(self, value):
        raise NotImplementedError

    def entropy(self):
        raise NotImplementedError

    def enumerate_support(self, expand=True):
        raise NotImplementedError

    def perplexity(self):
        return self.entropy().exp()

    def _extended_shape(self, sample_shape=()):
        if isinstance(sample_shape, int):
            sample_shape = (sample_shape,)
        return tuple(sample_shape) + self._batch_shape + self._event_shape

    def _validate_sample(self, value):
        """PyTorch's checks of log_prob's value: a Tensor, its trailing sizes the event shape,
        broadcastable with batch_shape + event_shape, inside the support."""
        if not isinstance(value, Tensor):
            raise ValueError(f"The value argument to log_prob must be a Tensor, got "
                             f"{type(value).__name__}")
        actual = tuple(value.shape)
        start = len(actual) - len(self._event_shape)
        if actual[start:] != self._event_shape:
            raise ValueError(f"The right-most size of value must match event_shape: {actual} vs "
                             f"{self._event_shape}.")
        expected = self._batch_shape + self._event_shape
        for i, j in zip(reversed(actual), reversed(expected)):
            if i != 1 and j != 1 and i != j:
                raise ValueError(f"Value is not broadcastable with batch_shape+event_shape: "
                                 f"{actual} vs {expected}.")
        try:
            support = self.support
        except NotImplementedError:
            warnings.warn(f"{self.__class__} does not define `support` to enable sample "
                          "validation. Please initialize the distribution with "
                          "`validate_args=False` to turn off validation.")
            return
        if not np.all(support.check(value)):
            raise ValueError(f"Expected value argument ({type(value).__name__} of shape "
                             f"{actual}) to be within the support ({support!r}) of the "
                             f"distribution {self!r}, but found invalid values:\n{value}")

    def __repr__(self):
        names = [k for k in self.arg_constraints if k in self.__dict__]
        shown = ", ".join(f"{p}: {_short(self.__dict__[p])}" for p in names)
        return f"{self.__class__.__name__}({shown})"


def _short(value):
    """A parameter in a repr: its value if it has one element, else its shape."""
    return value if value.numel() == 1 else tuple(value.shape)
