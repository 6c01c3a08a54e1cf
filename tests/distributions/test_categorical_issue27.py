"""hpcgrad.distributions.Categorical and Distribution (issue 27), against torch.distributions."""

import subprocess
import sys

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributions as D

PROBS = np.array([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]])  # a batch of 2, 3 events
LOGITS = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
VALUE = np.array([[2, 0], [1, 1]])  # sample_shape (2,) + batch (2,)


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("given, raw", [("probs", PROBS * 3), ("logits", LOGITS)])
def test_log_prob_and_entropy_values_and_gradients_match_torch(torch, given, raw):
    ours_param = hg.tensor(raw, requires_grad=True)
    torch_param = torch.tensor(raw, requires_grad=True)
    ours = D.Categorical(**{given: ours_param})
    theirs = torch.distributions.Categorical(**{given: torch_param})
    lp, tlp = ours.log_prob(hg.tensor(VALUE)), theirs.log_prob(torch.tensor(VALUE))
    np.testing.assert_allclose(lp.array, tlp.detach().numpy(), rtol=1e-12)
    ent, tent = ours.entropy(), theirs.entropy()
    np.testing.assert_allclose(ent.array, tent.detach().numpy(), rtol=1e-12)
    (g,) = hg.autograd.grad(lp.sum() + 0.5 * ent.sum(), [ours_param])
    (tg,) = torch.autograd.grad(tlp.sum() + 0.5 * tent.sum(), [torch_param])
    np.testing.assert_allclose(g.array, tg.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ours.probs.array, theirs.probs.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(ours.logits.array, theirs.logits.detach().numpy(), rtol=1e-12)


def test_shapes_support_mean_variance_mode_as_torch(torch):
    ours, theirs = D.Categorical(hg.tensor(PROBS)), torch.distributions.Categorical(
        torch.tensor(PROBS))
    assert ours.batch_shape == tuple(theirs.batch_shape) == (2,)
    assert ours.event_shape == tuple(theirs.event_shape) == ()
    assert ours.param_shape == tuple(theirs.param_shape) == (2, 3)
    assert np.isnan(ours.mean.array).all() and ours.mean.shape == tuple(theirs.mean.shape)
    assert np.isnan(ours.variance.array).all() and ours.variance.dtype == np.float64
    assert ours.mode.array.tolist() == theirs.mode.tolist()
    for expand in (True, False):
        np.testing.assert_array_equal(ours.enumerate_support(expand).array,
                                      theirs.enumerate_support(expand).numpy())
    assert repr(ours.support) == repr(theirs.support) == \
        "IntegerInterval(lower_bound=0, upper_bound=2)"
    assert ours.has_enumerate_support and not ours.has_rsample
    single = D.Categorical(logits=hg.tensor(LOGITS[0]))
    assert single.batch_shape == () and single.sample().shape == () and \
        single.sample((4, 5)).shape == (4, 5)


def test_sample_shapes_dtype_and_frequencies():
    m = D.Categorical(hg.tensor(PROBS))
    assert m.sample().shape == (2,) and m.sample().dtype == np.int64
    draws = m.sample((4000,)).array
    assert draws.shape == (4000, 2)
    for b in range(2):  # 4000 draws: each frequency within 0.04 of its probability
        np.testing.assert_allclose(np.bincount(draws[:, b], minlength=3) / 4000, PROBS[b],
                                   atol=0.04)
    zero = D.Categorical(hg.tensor(np.array([0.0, 1.0, 0.0])))
    assert set(zero.sample((200,)).array.tolist()) == {1}
    hg.manual_seed(5)
    first = m.sample((10,)).array
    hg.manual_seed(5)
    np.testing.assert_array_equal(m.sample((10,)).array, first)


def test_reinforce_idiom_from_pytorch_examples(torch):
    """distributed/rpc/batch/reinforce.py: m = Categorical(probs); a = m.sample();
    loss from m.log_prob(a): its gradient flows to the policy's output."""
    scores = hg.tensor(LOGITS[:1], requires_grad=True)
    probs = scores.softmax(-1)
    m = D.Categorical(probs)
    action = m.sample()
    (-m.log_prob(action) * 2.0).sum().backward()
    tscores = torch.tensor(LOGITS[:1], requires_grad=True)
    tm = torch.distributions.Categorical(tscores.softmax(-1))
    (-tm.log_prob(torch.tensor(action.array)) * 2.0).sum().backward()
    np.testing.assert_allclose(scores.grad.array, tscores.grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize("build, phrase", [
    (lambda c, t: c(t(np.array([-0.5, 1.0, 0.5]))),
     r"Expected parameter probs \(Tensor of shape \(3,\)\) of distribution Categorical\(probs: "),
    (lambda c, t: c(logits=t(np.array([0.0, np.nan]))),
     r"Expected parameter logits \(Tensor of shape \(2,\)\) .* to satisfy the constraint "
     r"IndependentConstraint\(Real\(\), 1\), but found invalid values"),
    (lambda c, t: c(t(np.array([0.2, 0.8])), t(np.array([0.2, 0.8]))),
     "Either `probs` or `logits` must be specified, but not both."),
    (lambda c, t: c(), "Either `probs` or `logits` must be specified, but not both."),
    (lambda c, t: c(t(np.array(1.0))), "`probs` parameter must be at least one-dimensional."),
])
def test_argument_errors_have_torchs_phrases(torch, build, phrase):
    with pytest.raises(ValueError, match=phrase):
        build(torch.distributions.Categorical, torch.tensor)
    with pytest.raises(ValueError, match=phrase):
        build(D.Categorical, hg.tensor)


def test_simplex_phrase_and_sample_validation(torch):
    with pytest.raises(ValueError, match=r"to satisfy the constraint Simplex\(\), but found "
                                         "invalid values"):
        D.Categorical(hg.tensor(np.array([-0.5, 1.0, 0.5])))
    m = D.Categorical(hg.tensor(PROBS))
    tm = torch.distributions.Categorical(torch.tensor(PROBS))
    for value, phrase in [
            (np.array([3, 0]), r"Expected value argument \(Tensor of shape \(2,\)\) to be within "
                               r"the support \(IntegerInterval\(lower_bound=0, upper_bound=2\)\) "
                               r"of the distribution Categorical"),
            (np.array([0, 1, 2]), "Value is not broadcastable with batch_shape"),
            (np.array([0.5, 1.0]), "to be within the support")]:
        with pytest.raises(ValueError, match=phrase):
            tm.log_prob(torch.tensor(value))
        with pytest.raises(ValueError, match=phrase):
            m.log_prob(hg.tensor(value))
    with pytest.raises(ValueError, match="The value argument to log_prob must be a Tensor"):
        m.log_prob([0, 1])


def test_validation_switches():
    bad = hg.tensor(np.array([-0.5, 1.0, 0.5]))
    D.Categorical(bad, validate_args=False)  # no check
    D.Distribution.set_default_validate_args(False)
    try:
        m = D.Categorical(bad)
        m.log_prob(hg.tensor(np.array(1)))
    finally:
        D.Distribution.set_default_validate_args(True)
    with pytest.raises(ValueError, match="Simplex"):
        D.Categorical(bad)
    with pytest.raises(ValueError):
        D.Distribution.set_default_validate_args("yes")


def test_expand_and_perplexity(torch):
    m = D.Categorical(hg.tensor(PROBS[0])).expand((4,))
    t = torch.distributions.Categorical(torch.tensor(PROBS[0])).expand((4,))
    assert m.batch_shape == tuple(t.batch_shape) and m.sample().shape == (4,)
    np.testing.assert_allclose(m.perplexity().array, t.perplexity().numpy(), rtol=1e-12)


def test_import_hpcgrad_alone_does_not_load_distributions():
    """The lead adds ``from . import distributions`` to hpcgrad/__init__.py; until then
    ``hpcgrad.distributions`` needs its own import (checked in a fresh interpreter)."""
    code = ("import hpcgrad; print(hasattr(hpcgrad, 'distributions')); "
            "import hpcgrad.distributions; print(hpcgrad.distributions.Categorical.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out[1] == "Categorical" and out[0] in ("True", "False")
