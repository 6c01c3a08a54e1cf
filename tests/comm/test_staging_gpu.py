"""Host staging on a real GPU: pinned copies ordered after the producer's stream, reused, written back.

tests/comm/test_staging.py checks the order of stream, event and copy calls with a stand-in cupy;
here the copies are real: a device array still being written by a long chain of kernels on a
non-blocking stream must reach the host with its final values, and come back.
"""

import numpy as np
import pytest

from hpcgrad.comm import buffers, staging
from hpcgrad.comm.buffers import MessageBuffer

pytestmark = pytest.mark.gpu  # conftest.py skips these without a usable GPU
cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install -e '.[cuda13]')")

N = 1 << 24


def _busy(stream, value=64):
    """A device array on ``stream`` that reaches ``value`` only after many queued kernels."""
    with stream:
        a = cupy.zeros(N, cupy.float32)
        for _ in range(value):
            a += 1
    return a


@pytest.fixture
def pool(monkeypatch):
    fresh = staging.StagingPool()
    monkeypatch.setattr(buffers, "STAGING", fresh)
    monkeypatch.setattr(buffers, "_cuda_aware", False)
    return fresh


def test_staged_copy_waits_for_the_producer_stream(pool):
    producer = cupy.cuda.Stream(non_blocking=True)
    a = _busy(producer)
    copy = buffers.stage_device_array(a, producer)  # returns at once; the copy is queued
    host = copy.wait()
    assert type(host) is np.ndarray and host.shape == (N,)
    assert host.min() == host.max() == 64, "the copy overtook the producer's kernels"
    host[...] = 5
    copy.release(copy.copy_back())
    assert bool((a == 5).all())
    again = buffers.stage_device_array(cupy.ones(N, cupy.float32))
    assert again.wait().min() == 1 and pool.allocations == 1  # the pinned buffer came back
    again.release()


def test_message_buffer_round_trip_on_the_current_stream(pool):
    producer = cupy.cuda.Stream(non_blocking=True)
    a = _busy(producer, 3)
    with producer:  # the producer is the current stream when MPI's buffer is made
        buf = MessageBuffer(a, writable=True)
    assert buf.spec[0].min() == 3
    buf.spec[0][...] *= 2  # what MPI would write
    buf.finish()
    assert bool((a == 6).all())


def test_float16_staged_as_float32(pool):
    a = cupy.asarray(np.array([1.0, 2.0, 65504.0], np.float16))
    buf = MessageBuffer(a, writable=True, upcast=True)
    assert buf.spec[0].dtype == np.float32
    buf.spec[0][...] = [0.5, 4097.0, 1.0]
    buf.finish()
    assert cupy.asnumpy(a).tolist() == [0.5, 4096.0, 1.0]
