"""Two LMCache servers standing for two nodes, sharing one second tier (L2).

A *node* is one real LMCache MP server (the oracle, :func:`tests.conftest.start_server`)
with ``--l2-adapter`` pointing at the shared tier; engines talk only to their own
node. The tiers are real: a Valkey node or a three-node Valkey cluster
(:mod:`tests.support.valkey`), or a directory both servers write (``fs`` /
``fs_native``), made and removed here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from lmcache_mp import Client, CpuKVCache

from ..conftest import REPO, SERVER_VERSION, LiveServer, start_server
from ..support.live_helpers import both_modes_args, fill_random
from ..support.valkey import ValkeyCluster, ValkeyNode

#: The two releases whose servers share an L2 format (0.5.6 and 0.5.7rc2 were tried).
OTHER_RELEASE = {"0.5.7rc2": "0.5.6", "0.5.6": "0.5.7rc2"}
FS_PREFIX = "lmcache_mp_l2fs_"


@dataclass
class Tier:
    """A shared second tier: the ``--l2-adapter`` JSON of each node and how many objects
    it holds (to prove the hit came through it)."""

    name: str
    adapter: dict[str, object]
    objects: Callable[[], int]
    close: Callable[[], None]
    valkey: ValkeyNode | None = None
    cluster: ValkeyCluster | None = None
    fs_dir: str | None = None

    def flag(self) -> tuple[str, str]:
        return ("--l2-adapter", json.dumps(self.adapter))


def _files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def make_tier(name: str) -> Tier:
    """A fresh tier of kind ``name``: fs, fs_native, resp, valkey, valkey_cluster."""
    if name in ("fs", "fs_native"):
        path = tempfile.mkdtemp(prefix=FS_PREFIX)
        return Tier(name, {"type": name, "base_path": path}, lambda: _files(path),
                    lambda: shutil.rmtree(path, ignore_errors=True), fs_dir=path)
    if name == "valkey_cluster":
        cluster = ValkeyCluster()
        return Tier(name, {"type": "valkey", "startup_nodes": cluster.startup_nodes,
                           "cluster_mode": True},
                    lambda: sum(cluster.keys_per_node()), cluster.close, cluster=cluster)
    node = ValkeyNode()
    adapter: dict[str, object] = (
        {"type": "resp", "host": "127.0.0.1", "port": node.port} if name == "resp"
        else {"type": "valkey", "startup_nodes": node.address})

    def count() -> int:
        size = node.command("DBSIZE")
        assert isinstance(size, int)
        return size

    return Tier(name, adapter, count, node.close, valkey=node)


@dataclass
class Nodes:
    """Servers A and B (of ``versions``) sharing ``tier``."""

    tier: Tier
    a: LiveServer
    b: LiveServer
    started: list[LiveServer] = field(default_factory=list)

    def close(self) -> None:
        for server in self.started:
            server.stop()


def node_server(tier: Tier, tag: str, version: str = SERVER_VERSION,
                *more: str) -> LiveServer:
    """One node: both transfer modes, an L1 pool of its own in shared memory, the tier."""
    return start_server(*both_modes_args(f"{tag}{os.getpid()}"), *tier.flag(), *more,
                        version=version)


def require_l2_release() -> None:
    if SERVER_VERSION not in OTHER_RELEASE:
        pytest.skip(f"LMCache {SERVER_VERSION}: the multi-node tests cover 0.5.6 and 0.5.7rc2 "
                    "(their oracle venvs carry valkey-glide for the valkey adapter)")


@contextmanager
def sharing(tier_name: str, versions: tuple[str, str] = (SERVER_VERSION, SERVER_VERSION),
            **adapter: object) -> Iterator[Nodes]:
    """A fresh tier (``adapter``: more of its ``--l2-adapter`` keys) and servers A and B
    sharing it; the servers stopped, then the tier."""
    require_l2_release()
    tier = make_tier(tier_name)
    tier.adapter.update(adapter)
    try:
        pair = start_nodes(tier, versions)
        try:
            yield pair
        finally:
            pair.close()
    finally:
        tier.close()


def start_nodes(tier: Tier, versions: tuple[str, str] = (SERVER_VERSION, SERVER_VERSION),
                *more: str) -> Nodes:
    started: list[LiveServer] = []
    try:
        for i, version in enumerate(versions):
            started.append(node_server(tier, f"mn{'ab'[i]}", version, *more))
    except BaseException:
        for server in started:
            server.stop()
        raise
    return Nodes(tier, started[0], started[1], started)


@pytest.fixture
def tier_factory() -> Iterator[Callable[[str], Tier]]:
    """Tiers made by the test, closed after it (servers first: see ``nodes_factory``)."""
    made: list[Tier] = []

    def make(name: str) -> Tier:
        made.append(make_tier(name))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


def log_path(server: LiveServer) -> Path:
    """The server's log file (what an operator points ``lmcache-mp doctor`` at)."""
    return Path(os.environ.get("LMCACHE_MP_ORACLE_DIR", REPO / ".oracle")) / "run" / \
        f"server-{server.port}.log"


def fs_leftovers() -> list[str]:
    return [p.name for p in Path(tempfile.gettempdir()).glob(f"{FS_PREFIX}*")]


# ------------------------------------------------------------------ a prefix across
CHUNK = 256
GEOMETRY = dict(num_layers=2, block_size=16, num_heads=2, head_dim=8, dtype="float16")


def prefix(seed: int, chunks: int = 4) -> list[int]:
    """``chunks`` whole chunks of seeded random token ids (a prefix no test shares)."""
    return [int(t) for t in np.random.default_rng(seed).integers(1, 50_000, chunks * CHUNK)]


@dataclass
class Shared:
    """What one prefix's trip A -> L2 -> B took (seconds)."""

    store_s: float
    visible_s: float  # from A's STORE reply until B's lookup found every chunk
    lookup_s: float  # B's lookup that found it (the L2 load inside)
    retrieve_s: float


class NodeCache:
    """A client of one node with a registered CPU cache (random bytes from ``seed``)."""

    def __init__(self, server: LiveServer, mode: str, seed: int, *,
                 model: str = "multinode-test", timeout: float = 10.0) -> None:
        self.client = Client(server.url, timeout=timeout)
        self.kv = CpuKVCache.allocate(num_blocks=16 * (CHUNK // 16) + 2, **GEOMETRY)  # type: ignore[arg-type]
        fill_random(self.kv, seed)
        try:
            self.reg = self.client.register(self.kv, model_name=model, mode=mode)
        except BaseException:
            self.close()
            raise

    def blocks(self, tokens: list[int], first: int = 1) -> list[int]:
        return list(range(first, first + len(tokens) // self.kv.geometry.block_size))

    def close(self) -> None:
        if hasattr(self, "reg"):
            self.reg.unregister()
        self.client.close()
        self.kv.close()

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share(a: NodeCache, b: NodeCache, tokens: list[int], *, timeout: float = 30.0) -> Shared:
    """Store ``tokens`` through ``a``, wait until ``b`` finds all of them (B's L1 never
    had them: only the L2 can answer), retrieve them through ``b`` into other blocks,
    and assert that B's bytes are A's."""
    src = a.blocks(tokens)
    dst = b.blocks(tokens, first=len(src) + 1)
    with b.reg.request(tokens) as probe:
        assert probe.lookup() == 0, "B found the prefix before A stored it"
    t0 = time.perf_counter()
    with a.reg.request(tokens) as writer:
        assert writer.store(src) is True
    stored = time.perf_counter()
    while True:
        reader = b.reg.request(tokens)
        t1 = time.perf_counter()
        found = reader.lookup()
        looked = time.perf_counter()
        if found == len(tokens):
            break
        reader.close()
        assert looked - stored < timeout, f"B found {found} of {len(tokens)} tokens"
        time.sleep(0.01)
    with reader:
        assert reader.retrieve(dst) is True
    retrieved = time.perf_counter()
    for layer in range(a.kv.geometry.num_layers):
        for s, d in zip(src, dst, strict=True):
            assert a.kv.block_bytes(layer, s) == b.kv.block_bytes(layer, d), \
                f"layer {layer}: B's block {d} differs from A's block {s}"
    return Shared(stored - t0, looked - stored, looked - t1, retrieved - looked)
