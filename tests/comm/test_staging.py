"""Device buffers before MPI and host staging that overlaps, checked with a stand-in cupy.

No GPU is needed: the stand-in records every stream, event and copy call in order and does the
copies in host memory (a "device" array is numpy memory of a subclass MessageBuffer takes for a
cupy array), as tests/base/kernels/test_scaled_copy.py's check_cuda_streams does for the kernels.
"""

import ctypes
import types

import numpy as np
import pytest

from hpcgrad import backend
from hpcgrad.comm import buffers, staging
from hpcgrad.comm.buffers import MessageBuffer


class DeviceArray(np.ndarray):
    """Stands for a cupy array on device 0: numpy memory with cupy's ``data.ptr`` and ``device``."""

    device = types.SimpleNamespace(id=0)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class FakeCupy:
    """Records ("record", event, stream), ("wait_event", stream, event), ("sync", event),
    ("memcpy", kind, stream) and ("pinned", nbytes) in ``log``, in the order they happen."""

    def __init__(self):
        log = self.log = []
        fake = self

        class Stream:
            def __init__(self, non_blocking=False, name=None):
                self.name = name or f"side{len(fake.streams)}"
                self.ptr = id(self)
                log.append(("stream", self.name, non_blocking))

            def wait_event(self, event):
                log.append(("wait_event", self.name, event.name))

        class Event:
            count = 0

            def __init__(self, disable_timing=False):
                Event.count += 1
                self.name, self.stream, self.done = f"event{Event.count}", None, False

            def record(self, stream=None):
                self.stream = stream.name
                log.append(("record", self.name, stream.name))

            def synchronize(self):
                self.done = True
                log.append(("sync", self.name))

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        def memcpy_async(dst, src, size, kind, stream_ptr):
            stream = next(s for s in fake.streams if s.ptr == stream_ptr)
            log.append(("memcpy", "D2H" if kind == 2 else "H2D", stream.name))
            ctypes.memmove(dst, src, size)

        def alloc_pinned_memory(nbytes):
            log.append(("pinned", nbytes))
            return bytearray(nbytes)

        def make_stream(non_blocking=False):
            stream = Stream(non_blocking)
            fake.streams.append(stream)
            return stream

        self.producer = Stream(name="producer")
        self.streams = [self.producer]
        log.clear()
        self.cuda = types.SimpleNamespace(
            Stream=make_stream, Event=Event, Device=Device,
            get_current_stream=lambda: self.producer,
            alloc_pinned_memory=alloc_pinned_memory,
            runtime=types.SimpleNamespace(memcpyAsync=memcpy_async, memcpyDeviceToHost=2,
                                          memcpyHostToDevice=1))

    def asnumpy(self, a):
        raise AssertionError("staging must not call cupy.asnumpy (a pageable copy per call)")

    def asarray(self, a):
        raise AssertionError("staging must not call cupy.asarray (a new device array per call)")


@pytest.fixture
def fake_cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setattr(backend, "is_gpu_array", lambda a: isinstance(a, DeviceArray))
    monkeypatch.setattr(backend, "cupy_module", lambda: fake)
    monkeypatch.setattr(buffers, "STAGING", staging.StagingPool())
    return fake


def _kinds(log, *kinds):
    return [e for e in log if e[0] in kinds]


def test_cuda_aware_waits_on_the_producer_event(fake_cupy, monkeypatch):
    monkeypatch.setattr(buffers, "_cuda_aware", True)
    a = np.arange(4.0).view(DeviceArray)
    buf = MessageBuffer(a, writable=True)
    assert buf.spec[0] is a and not buf.is_staged
    # One event, recorded on the current (producer's) stream and synchronized; no stream sync.
    assert _kinds(fake_cupy.log, "record", "sync") == [("record", "event1", "producer"),
                                                       ("sync", "event1")]


def test_given_stream_is_the_producer(fake_cupy, monkeypatch):
    monkeypatch.setattr(buffers, "_cuda_aware", True)
    mine = fake_cupy.cuda.Stream()
    MessageBuffer(np.zeros(3).view(DeviceArray), stream=mine)
    assert _kinds(fake_cupy.log, "record")[0][2] == mine.name != "producer"


def test_staged_copy_is_ordered_after_the_producer(fake_cupy, monkeypatch):
    monkeypatch.setattr(buffers, "_cuda_aware", False)
    a = np.arange(4.0).view(DeviceArray)
    buf = MessageBuffer(a, writable=True)
    assert type(buf.spec[0]) is np.ndarray and buf.spec[0].tolist() == [0, 1, 2, 3]
    steps = [e for e in fake_cupy.log if e[0] != "pinned"]
    assert steps == [
        ("record", "event1", "producer"),  # the producer's work so far
        ("stream", "side1", True),  # the side stream, non-blocking, made once
        ("wait_event", "side1", "event1"),  # the copy waits for the producer, on the device
        ("memcpy", "D2H", "side1"),
        ("record", "event2", "side1"),
        ("sync", "event2"),  # only the copy is waited for before MPI gets the spec
    ]
    buf.staged[...] = [9, 8, 7, 6]  # what MPI would write
    buf.finish()
    assert a.tolist() == [9, 8, 7, 6] and type(a) is DeviceArray
    assert fake_cupy.log[-3:] == [("memcpy", "H2D", "side1"), ("record", "event3", "side1"),
                                  ("sync", "event3")]


def test_pinned_buffers_are_reused(fake_cupy, monkeypatch):
    monkeypatch.setattr(buffers, "_cuda_aware", False)
    hosts = []
    for i in range(3):
        buf = MessageBuffer(np.full(5, float(i), np.float32).view(DeviceArray), writable=True)
        hosts.append(buf.staged)
        buf.finish()
    assert _kinds(fake_cupy.log, "pinned") == [("pinned", 20)]  # one allocation, no per call
    assert all(h.base is hosts[0].base for h in hosts) and buffers.STAGING.allocations == 1
    assert len(_kinds(fake_cupy.log, "stream")) == 1  # one side stream, made once
    # Two in flight at once get two buffers; a different size gets its own.
    first = MessageBuffer(np.zeros(5, np.float32).view(DeviceArray))
    second = MessageBuffer(np.zeros(5, np.float32).view(DeviceArray))
    assert first.staged.ctypes.data != second.staged.ctypes.data
    MessageBuffer(np.zeros(6, np.float32).view(DeviceArray))
    assert buffers.STAGING.allocations == 3


def test_staged_float16_goes_as_float32(fake_cupy, monkeypatch):
    monkeypatch.setattr(buffers, "_cuda_aware", False)
    a = np.array([1.0, 2.0], np.float16).view(DeviceArray)
    buf = MessageBuffer(a, writable=True, upcast=True)
    assert buf.staged.dtype == np.float32 and type(buf.staged) is np.ndarray
    buf.staged[...] = [0.5, 4097]
    buf.finish()
    assert a.dtype == np.float16 and a.tolist() == [0.5, 4096]
    assert _kinds(fake_cupy.log, "memcpy")[-1] == ("memcpy", "H2D", "side1")


def test_stage_device_array_does_not_block(fake_cupy):
    a = np.arange(3.0).view(DeviceArray)
    copy = buffers.stage_device_array(a)
    assert not _kinds(fake_cupy.log, "sync")  # the caller goes on (backward, in the reducer)
    assert copy.wait().tolist() == [0, 1, 2]
    copy.host[...] = 7
    copy.copy_back()
    copy.release()
    assert a.tolist() == [7, 7, 7]


def test_host_arrays_take_no_staging(fake_cupy):
    a = np.arange(4.0)
    buf = MessageBuffer(a, writable=True)
    assert buf.spec[0] is a and fake_cupy.log == []


class RecordingGroup:
    """Stands for a ProcessGroup of 2 ranks: records what each all-reduce got and, on wait,
    writes the sum of two equal contributions, as MPI would into the host copy."""

    def __init__(self, log):
        self.log, self.launched = log, []

    def iallreduce(self, array, op):
        self.log.append(("iallreduce", type(array).__name__))
        self.launched.append(array)
        return types.SimpleNamespace(wait=lambda: np.multiply(array, 2, out=array))


def test_reducer_stages_a_full_bucket_and_goes_on(fake_cupy, monkeypatch):
    from hpcgrad.ddp.reducer import Reducer
    monkeypatch.setattr(buffers, "_cuda_aware", False)
    reducer = Reducer.__new__(Reducer)  # only the bucket launch and finalize paths
    group = RecordingGroup(fake_cupy.log)
    buckets = [types.SimpleNamespace(contents=np.full(4, float(b + 1)).view(DeviceArray),
                                     pending=0, expect_sparse=False, staged=None, work=None)
               for b in range(2)]
    reducer.__dict__.update(buckets=buckets, next_bucket=0, comm_hook=None, _copying=[],
                            process_group=group, _comm_start=None)
    reducer.mark_bucket_ready(0)
    # Both copies enqueued on the side stream after the producer; nothing waited for, nothing
    # launched yet: the hook returns and backward goes on.
    assert _kinds(fake_cupy.log, "wait_event", "memcpy", "sync", "iallreduce") == [
        ("wait_event", "side1", "event1"), ("memcpy", "D2H", "side1"),
        ("wait_event", "side1", "event3"), ("memcpy", "D2H", "side1")]
    assert reducer.next_bucket == 2 and len(reducer._copying) == 2
    buckets[0].staged.copied.done = True  # the first copy completes; a later hook launches it
    reducer._launch_copied(block=False)
    assert [type(a) for a in group.launched] == [np.ndarray]
    reducer._launch_copied(block=True)  # finalize: the rest, in bucket order
    assert [a.tolist() for a in group.launched] == [[1.0] * 4, [2.0] * 4]
    for bucket in buckets:
        bucket.work.wait()
        Reducer._copy_back(bucket)
        assert bucket.staged is None
    assert [b.contents.tolist() for b in buckets] == [[2.0] * 4, [4.0] * 4]
    assert _kinds(fake_cupy.log, "memcpy")[-2:] == [("memcpy", "H2D", "side1")] * 2
    # The next iteration reuses both pinned buffers.
    pinned = len(_kinds(fake_cupy.log, "pinned"))
    reducer.next_bucket = 0
    reducer.mark_bucket_ready(0)
    assert len(_kinds(fake_cupy.log, "pinned")) == pinned == 2


def test_reducer_host_buckets_launch_at_once(fake_cupy):
    from hpcgrad.ddp.reducer import Reducer
    reducer = Reducer.__new__(Reducer)
    group = RecordingGroup(fake_cupy.log)
    bucket = types.SimpleNamespace(contents=np.ones(3), pending=0, expect_sparse=False,
                                   staged=None, work=None)
    reducer.__dict__.update(buckets=[bucket], next_bucket=0, comm_hook=None, _copying=[],
                            process_group=group, _comm_start=None)
    reducer.mark_bucket_ready(0)
    assert group.launched == [bucket.contents] and fake_cupy.log == [("iallreduce", "ndarray")]
