"""Fixtures of the DDP tests."""

import pytest

import hpcgrad.distributed as dist


@pytest.fixture
def group():
    """A fresh communicator per test, with a timeout: a hang fails instead of stalling the run."""
    dist.init_process_group()
    g = dist.new_group(timeout=60)
    yield g
    dist.destroy_process_group(g)
