"""A context released while a request is being served in it (Note [Released contexts stay
released] in hpcgrad/dist_autograd/context.py): the reply leaves without autograd metadata
instead of failing the call. The 4-rank race test_request_served_after_its_context_was_released
hit this now and then; here it is made to happen, in one process."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
from hpcgrad.dist_autograd import attach_send, container, context_guard


def test_a_reply_encoded_after_the_release_carries_no_context():
    context_id = (7 << 48) | 123  # a peer's context, first contacted by a request
    x = hg.tensor(np.ones(2), requires_grad=True)
    with context_guard(context_id) as current:
        assert current == context_id and attach_send([x]) is not None  # in the context
        container.release(context_id)  # the caller's release, handled meanwhile
        assert attach_send([x]) is None  # the reply goes out plainly
    assert container.get_or_create(context_id) is None  # and it stays released


def test_a_context_never_seen_is_still_an_error():
    with pytest.raises(RuntimeError, match="never created on this rank"):
        container.find((9 << 48) | 1)
    with dist_autograd.context() as context_id:
        assert container.find(context_id) is not None
