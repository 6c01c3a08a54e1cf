"""The constraints Distribution checks its parameters and samples against (torch.distributions.constraints)."""

import numpy as np

from hpcgrad.tensor._tensor import Tensor


def _array(value):
    return value.array if isinstance(value, Tensor) else np.asarray(value)


class Constraint:
    """A region of values; ``check(value)`` is a boolean array, reduced over ``event_dim``
    trailing dimensions (an event is valid only when all its elements are)."""

    is_discrete = False
    event_dim = 0

    def check(self, value):
        raise NotImplementedError

    def __repr__(self):
        return type(self).__name__[1:] + "()"


class _Dependent(Constraint):
    """Its region depends on other variables (a support given by the parameters)."""

    def check(self, value):
        raise ValueError("Cannot determine validity of dependent constraint")


class _Real(Constraint):
    def check(self, value):
        data = _array(value)
        return data == data  # false for NaN only


class _IndependentConstraint(Constraint):
    """``base`` over ``reinterpreted_batch_ndims`` more trailing dimensions."""

    def __init__(self, base, reinterpreted_batch_ndims):
        self.base_constraint, self.reinterpreted_batch_ndims = base, reinterpreted_batch_ndims
        self.event_dim = base.event_dim + reinterpreted_batch_ndims

    def check(self, value):
        result = self.base_constraint.check(value)
        if result.ndim < self.reinterpreted_batch_ndims:
            raise ValueError(f"Expected value.dim() >= {self.reinterpreted_batch_ndims} but got "
                             f"{result.ndim}")
        return result.reshape(result.shape[:result.ndim - self.reinterpreted_batch_ndims]
                              + (-1,)).all(-1)

    def __repr__(self):
        return f"IndependentConstraint({self.base_constraint!r}, {self.reinterpreted_batch_ndims})"


class _Simplex(Constraint):
    """Non-negative entries summing to 1 (within 1e-6) along the last dimension."""

    event_dim = 1

    def check(self, value):
        data = _array(value)
        return (data >= 0).all(-1) & (np.abs(data.sum(-1) - 1) < 1e-6)


class _IntegerInterval(Constraint):
    """Integers in [lower_bound, upper_bound]."""

    is_discrete = True

    def __init__(self, lower_bound, upper_bound):
        self.lower_bound, self.upper_bound = lower_bound, upper_bound

    def check(self, value):
        data = _array(value)
        return (data % 1 == 0) & (self.lower_bound <= data) & (data <= self.upper_bound)

    def __repr__(self):
        return (f"IntegerInterval(lower_bound={self.lower_bound}, "
                f"upper_bound={self.upper_bound})")


dependent = _Dependent()
real = _Real()
real_vector = _IndependentConstraint(real, 1)
simplex = _Simplex()
integer_interval = _IntegerInterval
independent = _IndependentConstraint


def is_dependent(constraint):
    return isinstance(constraint, _Dependent)
