"""Fixtures of the hpcgrad.distributed tests: the default group, created once per process."""

import pytest

import hpcgrad.distributed as dist

# A test that fails on one rank leaves its peers in a collective: they get a CommTimeoutError
# after this long (and report it) instead of hanging until the run's MPIEXEC_TIMEOUT.
GROUP_TIMEOUT = 30


@pytest.fixture
def world():
    """The default process group (init_process_group is idempotent: the first call creates it)."""
    return dist.init_process_group(timeout=GROUP_TIMEOUT)
