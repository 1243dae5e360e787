"""NHD caches and wrapped host arrays against a real server, byte for byte: round trips
in each mode the release supports, and chunks crossing between NHD and HND caches."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_mp import Client, CpuKVCache, InvalidArgument, Registration

from ..conftest import SERVER_VERSION, LiveServer
from ..support.live_helpers import fill_random, lookup_all, our_segments

pytestmark = pytest.mark.live
CHUNK = 256
L, BS, H, D = 2, 16, 4, 32
TOKENS = 2 * CHUNK
N = TOKENS // BS
# CPU servers up to 0.5.4 read 5-D layers as HND whatever kv_layout says.
NHD_SERVER_COPY = SERVER_VERSION not in ("0.5.3", "0.5.4")


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[Client]:
    with Client(live_server.url, timeout=10.0) as c:
        yield c


@pytest.fixture(autouse=True)
def no_segment_leak() -> Iterator[None]:
    before = our_segments()
    yield
    assert our_segments() == before, "SHM segments left behind"


def allocate(layout: str) -> CpuKVCache:
    return CpuKVCache.allocate(num_layers=L, num_blocks=3 * N + 1, block_size=BS,
                               num_heads=H, head_dim=D, dtype="bfloat16",
                               layout=layout)  # type: ignore[arg-type]


def token_major(kv: CpuKVCache, layer: int, block: int) -> bytes:
    """One block of one layer as [2, block_size, heads, head_dim] bytes, whatever the
    cache's layout: the form in which blocks of different layouts compare."""
    b = kv.layers[layer][:, block]
    return (b if kv.geometry.layout == "NHD" else b.transpose(0, 2, 1, 3)).tobytes()


def store_then_retrieve(writer: Registration, reader: Registration) -> None:
    """Store blocks 1..N of ``writer``'s cache, retrieve them into scattered blocks of
    ``reader``'s, and compare token-major bytes (the rest of ``reader`` untouched)."""
    src = list(range(1, N + 1))
    dst = [int(b) for b in np.random.default_rng(1).permutation(np.arange(N + 1, 3 * N + 1))[:N]]
    tokens = np.random.default_rng(uuid.uuid4().int % 2**32).integers(0, 2**31, TOKENS).tolist()
    fill_random(writer.cache, seed=5)  # type: ignore[arg-type]
    with writer.request(tokens) as w:
        assert w.store(src) is True
    inp, out = writer.cache, reader.cache
    assert isinstance(inp, CpuKVCache) and isinstance(out, CpuKVCache)
    expect = [[token_major(inp, li, s) for s in src] for li in range(L)]
    for layer in out.layers:  # may be the writer's own cache: expect was taken first
        layer[...] = 0
    with lookup_all(reader, tokens) as r:
        assert r.retrieve(dst) is True
    for li in range(L):
        for i, d in enumerate(dst):
            assert token_major(out, li, d) == expect[li][i], (li, src[i], d)
        rest = sorted(set(range(out.geometry.num_blocks)) - set(dst))
        assert not out.layers[li][:, rest].any()


def register(client: Client, kv: CpuKVCache, mode: str, model: str) -> Registration:
    try:
        return client.register(kv, model_name=model, mode=mode)
    except BaseException:
        kv.close()
        raise


@pytest.mark.parametrize("mode", ["engine", "lmcache"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_round_trip_in_each_layout(client: Client, layout: str, mode: str) -> None:
    model = f"lay-{uuid.uuid4().hex[:8]}"
    if mode == "lmcache" and layout == "NHD" and not NHD_SERVER_COPY:
        kv = allocate("NHD")
        with kv, pytest.raises(InvalidArgument, match="read 5-D layers as HND"):
            client.register(kv, model_name=model, mode="lmcache")
        return
    reg = register(client, allocate(layout), mode, model)
    try:
        store_then_retrieve(reg, reg)
    finally:
        reg.unregister()
        reg.cache.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["engine", "lmcache"])
@pytest.mark.parametrize(("src_layout", "dst_layout"), [("NHD", "HND"), ("HND", "NHD")])
def test_a_chunk_crosses_layouts(client: Client, src_layout: str, dst_layout: str,
                                 mode: str) -> None:
    """One model, two caches: what one layout stores, the other reads back (the chunk
    objects on the server are layout-free)."""
    if mode == "lmcache" and not NHD_SERVER_COPY:
        pytest.skip(f"LMCache {SERVER_VERSION} CPU servers copy HND only (NHD refused, "
                    f"see test_round_trip_in_each_layout); engine mode covers the cross")
    model = f"cross-{uuid.uuid4().hex[:8]}"
    writer = register(client, allocate(src_layout), mode, model)
    try:
        reader = register(client, allocate(dst_layout), mode, model)
        try:
            store_then_retrieve(writer, reader)
        finally:
            reader.unregister()
            reader.cache.close()  # type: ignore[attr-defined]
    finally:
        writer.unregister()
        writer.cache.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_wrapped_host_arrays_round_trip_engine_driven(client: Client, layout: str) -> None:
    """vLLM-style: one allocation, per-layer strided views, wrapped without a copy; what
    it stores an SHM cache of the other layout reads back, and vice versa."""
    nb = 3 * N + 1
    inner = (BS, H) if layout == "NHD" else (H, BS)
    big = np.zeros((nb, L, 2, *inner, D), np.uint16)  # blocks-first, one allocation
    views = [big[:, li].swapaxes(0, 1) for li in range(L)]
    wrapped = CpuKVCache.wrap(views, layout=layout, block_size=BS,  # type: ignore[arg-type]
                              dtype="bfloat16")
    model = f"wrap-{uuid.uuid4().hex[:8]}"
    reg = client.register(wrapped, model_name=model)  # "auto": engine-driven
    assert reg.mode == "engine"
    try:
        other = register(client, allocate("HND" if layout == "NHD" else "NHD"), "engine",
                         model)
        try:
            store_then_retrieve(reg, other)
            store_then_retrieve(other, reg)
            assert np.shares_memory(wrapped.layers[0], big) and big.any()
        finally:
            other.unregister()
            other.cache.close()  # type: ignore[attr-defined]
    finally:
        reg.unregister()
        wrapped.close()
