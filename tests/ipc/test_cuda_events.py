"""The CUDA cache's event protocol around each STORE / RETRIEVE, with the fake driver.

* our event: recorded on the caller's stream, kept until the reply, then destroyed;
* the server's event: a handler-local the server destroys after exporting it, so each
  reply's handle is opened, waited on and destroyed, never cached by its bytes;
* ``stream=None``: torch's current stream when torch has CUDA initialised (never
  imported by us), else the legacy default stream; the same stream for both halves;
* replies that carry no cudaIpcEventHandle_t are refused with what to do.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_mp.errors import InvalidArgument, ProtocolMismatch
from lmcache_mp.ipc.cuda import (
    IPC_HANDLE_SIZE,
    CudaError,
    CudaKVCache,
    TransferEvent,
    UnsupportedServerEvent,
    default_stream,
)

from ..support.fake_cuda import FakeDriver
from ..support.fixture_values import load


def small_cache(drv: FakeDriver, **kw: Any) -> CudaKVCache:
    args: dict[str, Any] = dict(num_layers=2, num_blocks=8, block_size=16, num_heads=2,
                                head_dim=64, dtype="bfloat16", driver=drv)
    args.update(kw)
    return CudaKVCache.allocate(**args)


def server_handle(n: int) -> bytes:
    return b"S" + bytes([n]) * (IPC_HANDLE_SIZE - 1)


def event_calls(drv: FakeDriver) -> list[tuple[Any, ...]]:
    return [c for c in drv.calls if c[0] in ("open", "wait", "destroy", "stream_sync",
                                             "event_sync")]


# ------------------------------------------------------------ one transfer
def test_reply_event_is_opened_waited_on_and_destroyed() -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    handle, token = cache.begin_transfer(0x99)
    assert isinstance(handle, bytes) and len(handle) == IPC_HANDLE_SIZE
    assert isinstance(token, TransferEvent) and not token.destroyed
    ours = drv.events[token.event]
    assert ours["recorded_on"] == 0x99 and ours["kind"] == "ours"
    assert token.stream == 0x99

    drv.calls.clear()
    cache.end_transfer(server_handle(1), 0x99, token)
    assert token.destroyed and ours["destroyed"]
    opened = [e for e in drv.events.values() if e["kind"] == "opened"]
    assert len(opened) == 1 and opened[0]["destroyed"]
    # open, then the wait on the caller's stream, then destroy the opened event; our
    # own event goes last.
    assert event_calls(drv) == [("open", server_handle(1), 0), ("wait", 0x99, server_handle(1)),
                                ("destroy", server_handle(1)), ("destroy", token.event)]
    assert not any(c[0] in ("stream_sync", "event_sync") for c in drv.calls)
    cache.close()


def test_each_reply_opens_its_handle_afresh_even_when_the_bytes_repeat() -> None:
    """The driver recycles IPC event slots: equal bytes may be a new server event."""
    drv = FakeDriver()
    cache = small_cache(drv)
    for n in (1, 2, 1, 1, 2):
        _, tok = cache.begin_transfer(None)
        cache.end_transfer(server_handle(n), None, tok)
    assert drv.opened == {server_handle(1): 3, server_handle(2): 2}
    assert sum(1 for c in drv.calls if c[0] == "wait") == 5
    # Nothing is held open between replies.
    assert all(e["destroyed"] for e in drv.events.values())
    cache.close()


def test_wait_host_synchronizes_after_the_wait() -> None:
    drv = FakeDriver()
    cache = small_cache(drv, wait_host=True)
    _, tok = cache.begin_transfer(5)
    drv.calls.clear()
    cache.end_transfer(server_handle(3), 5, tok)
    assert event_calls(drv) == [("open", server_handle(3), 0), ("wait", 5, server_handle(3)),
                                ("destroy", server_handle(3)), ("stream_sync", 5),
                                ("destroy", tok.event)]
    drv.calls.clear()
    cache.synchronize_server_event(server_handle(3))
    assert event_calls(drv) == [("open", server_handle(3), 0),
                                ("event_sync", server_handle(3)), ("destroy", server_handle(3))]
    cache.synchronize(7)
    assert drv.calls[-1] == ("stream_sync", 7)
    cache.close()


def test_a_failing_wait_still_destroys_both_events() -> None:
    class WaitFails(FakeDriver):
        def stream_wait_event(self, stream: int, event: int) -> None:
            raise CudaError("cudaStreamWaitEvent failed: cudaErrorInvalidResourceHandle",
                            code=400)

    drv = WaitFails()
    cache = small_cache(drv)
    _, tok = cache.begin_transfer(None)
    with pytest.raises(CudaError, match="cudaStreamWaitEvent"):
        cache.end_transfer(server_handle(1), None, tok)
    assert tok.destroyed and all(e["destroyed"] for e in drv.events.values())
    cache.close()


def test_unanswered_transfer_event_is_destroyed_when_dropped() -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    _, tok = cache.begin_transfer(None)
    ev = drv.events[tok.event]
    del tok
    gc.collect()
    assert ev["destroyed"]
    cache.close()


def test_events_use_the_caches_device() -> None:
    drv = FakeDriver(devices=2)
    cache = small_cache(drv, device=1)
    _, tok = cache.begin_transfer(None)
    assert drv.events[tok.event]["device"] == 1 and drv.device == 0
    cache.end_transfer(server_handle(1), None, tok)
    opened = [e for e in drv.events.values() if e["kind"] == "opened"]
    assert [e["device"] for e in opened] == [1]
    assert drv.device == 0
    cache.close()


def test_closed_cache_refuses_new_transfers() -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    cache.close()
    with pytest.raises(InvalidArgument, match="closed"):
        cache.begin_transfer(None)


# ------------------------------------------------------- replies we refuse
@pytest.mark.parametrize("release", ["0.5.5", "0.5.6"])
def test_isolated_ipc_reply_is_refused_accurately(release: str) -> None:
    """An --isolated-ipc server's 81-byte timeline-semaphore handle (bytes from the
    release's own wire struct) is not mistaken for CPU mode."""
    handle = bytes.fromhex(next(c["data"] for c in load(release, "events")
                                if c["kind"] == "timeline_semaphore"))
    drv = FakeDriver()
    cache = small_cache(drv)
    _, tok = cache.begin_transfer(None)
    with pytest.raises(UnsupportedServerEvent) as info:
        cache.end_transfer(handle, None, tok)
    msg = str(info.value)
    assert "--isolated-ipc" in msg and "timeline-semaphore" in msg
    assert "not running in GPU mode" not in msg
    assert isinstance(info.value, ProtocolMismatch) and isinstance(info.value, CudaError)
    assert tok.destroyed and drv.opened == {}
    with pytest.raises(UnsupportedServerEvent, match="--isolated-ipc"):
        cache.synchronize_server_event(handle)
    cache.close()


@pytest.mark.parametrize("bad", [
    bytes.fromhex(load("0.5.3", "events")[0]["data"]),  # the CPU server's stub
    b"", bytes(63), bytes(81), b"\x02" + bytes(80), "x" * 64,
])
def test_non_gpu_replies_say_the_server_is_not_in_gpu_mode(bad: Any) -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    _, tok = cache.begin_transfer(None)
    with pytest.raises(UnsupportedServerEvent, match="not running in GPU mode"):
        cache.end_transfer(bad, None, tok)
    assert tok.destroyed and drv.opened == {}
    cache.close()


# ------------------------------------------------------ the default stream
class FakeTorchCuda:
    def __init__(self, initialized: bool, stream: int) -> None:
        self.initialized = initialized
        self.stream = stream
        self.asked: list[int] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def current_stream(self, device: int) -> Any:
        self.asked.append(device)
        return types.SimpleNamespace(cuda_stream=self.stream)


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchCuda]:
    cuda = FakeTorchCuda(initialized=True, stream=0x5151)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    yield cuda


def test_none_is_the_legacy_default_stream_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert default_stream(0) == 0
    drv = FakeDriver()
    cache = small_cache(drv)
    _, tok = cache.begin_transfer(None)
    assert drv.events[tok.event]["recorded_on"] == 0
    assert "torch" not in sys.modules  # never imported by us
    cache.end_transfer(server_handle(1), None, tok)
    cache.close()


def test_none_is_torchs_current_stream_when_torch_uses_cuda(fake_torch: FakeTorchCuda) -> None:
    drv = FakeDriver(devices=2)
    cache = small_cache(drv, device=1, wait_host=True)
    _, tok = cache.begin_transfer(None)
    assert drv.events[tok.event]["recorded_on"] == 0x5151
    assert fake_torch.asked == [1]  # the cache's device, not the caller's
    # The reply may be handled where torch's current stream differs: the wait still
    # goes on the stream the request was recorded on.
    fake_torch.stream = 0x7777
    cache.end_transfer(server_handle(1), None, tok)
    assert ("wait", 0x5151, server_handle(1)) in drv.calls
    assert ("stream_sync", 0x5151) in drv.calls
    cache.synchronize()
    assert drv.calls[-1] == ("stream_sync", 0x7777)
    cache.close()


def test_explicit_streams_win_and_uninitialised_torch_means_zero(
        fake_torch: FakeTorchCuda) -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    _, tok = cache.begin_transfer(0x42)
    assert drv.events[tok.event]["recorded_on"] == 0x42
    cache.end_transfer(server_handle(1), 0x43, tok)  # an explicit stream at the end too
    assert ("wait", 0x43, server_handle(1)) in drv.calls
    fake_torch.initialized = False
    _, tok = cache.begin_transfer(None)
    assert drv.events[tok.event]["recorded_on"] == 0
    cache.end_transfer(server_handle(2), None, tok)
    cache.close()


def test_a_broken_torch_falls_back_to_the_legacy_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def is_initialized(self) -> bool:
            raise RuntimeError("Torch not compiled with CUDA enabled")

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=Broken()))
    assert default_stream(0) == 0
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    assert default_stream(0) == 0
