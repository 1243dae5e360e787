"""The vLLM connector in vLLM's real scheduler machinery, against real LMCache servers.

Each engine is a fresh process (``harness.py`` under ``.venv-vllm``, or under the
server release's oracle venv for LMCache's own connector), so what one engine stores
another loads through the server only. The processes are forked from ``zygote.py``,
one per connector, which has imported vLLM and nothing more (an engine starts in
~0.1 s, not ~9 s: the vLLM tests take a third of the time).
The KV caches are vLLM's own allocation (``allocate_kv_cache``) in the layout vLLM
resolves for the attention backend (CPU_ATTN, as on vLLM's CPU engine: ``LBHNC``;
FLASH_ATTN's layouts, layer-compact and blocks-first, as a GPU engine's). Loaded KV
is checked byte for byte against the pattern the storing engine's fake forward pass
wrote (``harness.pattern``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp import CacheKey, Client, CpuKVCache
from tests.conftest import REPO, SERVER_SCRIPT, SERVER_VERSION, LiveServer, start_server
from tests.integrations.vllm.engines import ENGINE_LOGS, ZYGOTE, Zygote, engine_command, engine_env
from tests.support.live_helpers import both_modes_args

pytestmark = pytest.mark.live

HARNESS = Path(__file__).with_name("harness.py")
SETTLE_S = 1.0  # after an engine of LMCache's connector, before the next (run_engine)
CHUNK = 256  # the servers' default chunk size
# Placement over several servers and a dead server do not depend on the release: run
# them against the first release and the newest (the moving target) only (CI time).
EDGE_RELEASE = SERVER_VERSION in ("0.5.3", "0.5.7rc2")
edge_only = pytest.mark.skipif(not EDGE_RELEASE, reason=(
    "release-independent (rank placement, a dead server, a failed load): run against "
    "0.5.3 and 0.5.7rc2"))
newest_only = pytest.mark.skipif(SERVER_VERSION != "0.5.7rc2", reason=(
    "rank placement over two servers does not depend on the release or the transfer "
    "mode: against 0.5.7rc2 only (CI time)"))
# Against 0.5.4 and 0.5.5 (releases between 0.5.3, 0.5.6 and the newest) only what
# tells one release from another to the connector: a fresh engine loading what another
# stored (the release's wire, registration and transfer mode) and the crosses with
# that release's own connector (the same cache entries). Tensor parallelism, MLA
# alone, a held session id, a restart mid-stream and sleep / wake run against 0.5.3
# (LMCache-driven), 0.5.6 (the first 0.5.6 wire) and the newest (CI time: ~50 s of
# each of those two jobs).
WIDE_RELEASE = SERVER_VERSION not in ("0.5.4", "0.5.5")
wide_only = pytest.mark.skipif(not WIDE_RELEASE, reason=(
    "the same for 0.5.4 and 0.5.5 as for 0.5.3, 0.5.6 and 0.5.7rc2 (their stores, loads "
    "and crosses with LMCache's connector run here)"))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


_zygotes: dict[str, Zygote] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_zygotes() -> Any:
    yield
    while _zygotes:
        _zygotes.popitem()[1].close()


def run_engine(tmp_path: Path, connector: str, urls: list[str], phases: list[dict[str, Any]],
               *, tp: int = 1, extra: dict[str, Any] | None = None,
               timeout: float = 240, mla: bool = False, backend: str = "CPU_ATTN",
               layout: str | None = None, **engine: Any) -> dict[str, Any]:
    """One engine process on a fresh spec. Forked from a per-connector ``zygote.py``
    (vLLM already imported) unless LMCACHE_MP_VLLM_ZYGOTE=0, then a fresh interpreter.
    ``backend`` / ``layout``: the attention backend and ``VLLM_KV_CACHE_LAYOUT``;
    ``engine``: more of the spec (``num_blocks``, ``prefix_caching``, ``extensible``:
    harness.main)."""
    spec = {"connector": connector, "tp": tp, "mla": mla, "phases": phases,
            "backend": backend, "layout": layout, **engine,
            "extra": {"lmcache.mp.server_urls": urls, **(extra or {})}}
    path = tmp_path / f"spec-{random.getrandbits(32)}.json"
    path.write_text(json.dumps(spec))
    if os.environ.get("LMCACHE_MP_VLLM_ZYGOTE", "1") == "1":
        if connector not in _zygotes:
            argv = engine_command(connector, ZYGOTE) + (["--lmcache"] if connector != "ours"
                                                        else [])
            _zygotes[connector] = Zygote(argv, engine_env(),
                                         tmp_path / f"zygote-{connector}.log")
        rc, stdout, stderr = _zygotes[connector].run(path, timeout)
        # LMCache commits a STORE's chunks shortly after its reply on some releases: an
        # engine of ours waits until its stores are visible (harness.wait_visible);
        # LMCache's connector cannot be asked, so the next engine starts a bit later.
        if connector != "ours":
            time.sleep(SETTLE_S)
    else:
        try:
            proc = subprocess.run(engine_command(connector, HARNESS) + [str(path)],
                                  capture_output=True, text=True, timeout=timeout,
                                  env=engine_env(), cwd=REPO)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = None, str(exc.stdout or ""), str(exc.stderr or "")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        why = f"ran past {timeout} s" if rc is None else f"rc {rc}"
        raise AssertionError(f"harness failed ({why}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    result["log"] = stderr
    ENGINE_LOGS.append((f"{connector} engine, tp={tp}, mla={mla}", stderr))
    return result


def req(rid: str, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt, **({"salt": salt} if salt else {})}


@pytest.fixture(scope="module")
def server() -> Any:
    s = start_server(*both_modes_args(f"vllm{os.getpid()}"))
    yield s
    s.stop()


def loaded(result: dict[str, Any], rid: str) -> int:
    r = result["requests"][rid]
    assert r["verified"], f"{rid}: KV bytes differ from what the storing engine computed"
    return int(r["first_computed"])


def test_store_then_fresh_engine_loads(server: LiveServer, tmp_path: Path) -> None:
    p = tokens(1, 3 * CHUNK + 40)
    first = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p, "t1")]}])
    assert loaded(first, "a") == 0 and first["stats"]["stored"] == 1
    # A fresh engine (empty vLLM prefix cache) loads the 3 whole chunks; another salt
    # and a salt LMCache would reject (bypass, no error) load nothing.
    second = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("b", p, "t1"), req("c", p, "t2"), req("d", p, "bad@salt")]}])
    assert loaded(second, "b") == 3 * CHUNK
    assert loaded(second, "c") == 0 and loaded(second, "d") == 0
    assert second["stats"]["load_errors"] == 0
    # vLLM's own prefix hit inside a chunk: the retrieve skips it (skip_first_n_tokens).
    third = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("e", p[:CHUNK + 32])]},
        {"requests": [req("f", p, "t1")]}])
    assert loaded(third, "f") == 3 * CHUNK


def test_cross_with_lmcache_connector(server: LiveServer, tmp_path: Path) -> None:
    # vLLM's CPU engine's caches (CPU_ATTN, LBHNC): every release's connector reads
    # them as fused K/V and stores [layers, chunk, heads * 2 * head_size] objects.
    p1, p2 = tokens(11, 2 * CHUNK + 7), tokens(12, 3 * CHUNK)
    # LMCache's connector stores p1; ours loads it and stores p2; LMCache's loads p2.
    a = run_engine(tmp_path, "lmcache", [server.url], [{"requests": [req("l1", p1, "s")]}])
    assert loaded(a, "l1") == 0
    b = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("o1", p1, "s"), req("o2", p2, "s")]}])
    assert loaded(b, "o1") == 2 * CHUNK, "ours did not load what LMCache's connector stored"
    assert loaded(b, "o2") == 0
    c = run_engine(tmp_path, "lmcache", [server.url], [{"requests": [req("l2", p2, "s")]}])
    # A full-prompt hit: vLLM recomputes the last token, so one token less is loaded.
    assert loaded(c, "l2") == 3 * CHUNK - 1, "LMCache's connector did not load what ours stored"


@edge_only
@pytest.mark.parametrize(("stored_in", "loaded_in"), [
    ("LBNHC", "BLNHC"), ("BLHNC", "LBHNC")])
def test_entries_do_not_depend_on_the_physical_layout(
        server: LiveServer, tmp_path: Path, stored_in: str, loaded_in: str) -> None:
    # A GPU backend's caches (FLASH_ATTN: K and V side by side in each row) in two of
    # the layouts vLLM can resolve, layer-compact and blocks-first: an entry stored
    # from one loads into the other byte for byte (as the backend reads it).
    p = tokens({"LBNHC": 101, "BLHNC": 102}[stored_in], 2 * CHUNK + 9)
    a = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p, "x")]}],
                   backend="FLASH_ATTN", layout=stored_in)
    assert loaded(a, "a") == 0 and a["stats"]["stored"] == 1
    b = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("b", p, "x")]}],
                   backend="FLASH_ATTN", layout=loaded_in)
    assert loaded(b, "b") == 2 * CHUNK and b["stats"]["load_errors"] == 0


@wide_only
def test_tensor_parallel_two_ranks(server: LiveServer, tmp_path: Path) -> None:
    p = tokens(21, 2 * CHUNK + 5)
    a = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("t", p)]}], tp=2)
    assert a["stats"]["stored"] == 2  # one STORE per rank, each its own KV shard
    b = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("u", p)]}], tp=2)
    assert loaded(b, "u") == 2 * CHUNK and b["stats"]["retrieved"] == 2
    # A TP=1 engine has another world size: another cache entry.
    c = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("v", p)]}])
    assert loaded(c, "v") == 0


@wide_only
def test_mla_store_then_fresh_engine_loads(server: LiveServer, tmp_path: Path) -> None:
    # A tiny DeepSeek-V2 (use_mla): 3-D latent layers, one object plane on the server.
    p = tokens(71, 3 * CHUNK + 11)
    first = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p)]}],
                       mla=True)
    assert loaded(first, "a") == 0 and first["stats"]["stored"] == 1
    second = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("b", p)]}],
                        mla=True)
    assert loaded(second, "b") == 3 * CHUNK and second["stats"]["load_errors"] == 0


@wide_only
def test_mla_tensor_parallel_two_ranks(server: LiveServer, tmp_path: Path) -> None:
    p = tokens(72, 2 * CHUNK + 5)
    a = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("t", p)]}], tp=2,
                   mla=True)
    # MLA's latent KV is replicated over TP: only rank 0 stores (LMCache's rule).
    assert loaded(a, "t") == 0 and a["stats"]["stored"] == 1
    b = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("u", p)]}], tp=2,
                   mla=True)
    # Both ranks read the one entry (two read locks per chunk), byte-exact on each.
    assert loaded(b, "u") == 2 * CHUNK and b["stats"]["retrieved"] == 2
    assert b["stats"]["load_errors"] == 0
    # The key's world size is the pipeline-stage count (1) whatever the TP size: a TP=1
    # engine hits the same entries.
    c = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("v", p)]}], mla=True)
    assert loaded(c, "v") == 2 * CHUNK


@wide_only
def test_request_id_the_server_already_holds_a_session_for(server: LiveServer,
                                                          tmp_path: Path) -> None:
    """CI's MLA TP=2 failure (issue 19), made to happen every time. Every release keys
    a server session by request id alone and keeps the chunk hashes of the first prompt
    it saw under it (``Session.set_tokens`` replaces the tokens, not the hashes; 600 s
    TTL): an engine that reuses an id whose session is still there hits on LOOKUP
    (hashed afresh) and then RETRIEVEs, and STOREs, under the *old* prompt's hashes.
    In CI the session was left by an earlier test's engine whose last STORE reached the
    server after its END_SESSION. The connector sends its own session id per request
    instance (and END_SESSION after the stores), so the load works."""
    p, other = tokens(63, 2 * CHUNK + 5), tokens(64, 2 * CHUNK)
    a = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("w1", p)]}])
    assert loaded(a, "w1") == 0 and a["stats"]["stored"] == 1
    # Leave a session "w2" holding another prompt's hashes: a STORE under that id whose
    # session nothing ends.
    with Client(server.url, timeout=10.0) as client:
        kv = CpuKVCache.allocate(num_layers=1, num_blocks=2 * CHUNK // 16, block_size=16,
                                 num_heads=1, head_dim=8, dtype="float16")
        reg = client.register(kv, model_name=f"stale-session-{os.getpid()}", mode="engine")
        try:
            key = CacheKey(model_name=reg.model_name, world_size=reg.world_size,
                           worker_id=reg.worker_id, token_ids=other, start=0, end=2 * CHUNK,
                           request_id="w2")
            assert reg.store_async(key, list(range(2 * CHUNK // 16))).result() is True
        finally:
            reg.unregister()
    b = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("w2", p)]}])
    assert b["stats"]["load_errors"] == 0, "the RETRIEVE found nothing after a hit"
    assert loaded(b, "w2") == 2 * CHUNK


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_cross_with_lmcache_connector(server: LiveServer, tmp_path: Path,
                                          tp: int) -> None:
    # Every release's connector handles MLA on a CPU server (3-D latent layers have no
    # NHD / HND question, the one 0.5.3 / 0.5.4's connector gets wrong for 5-D layers).
    p1, p2 = tokens(81 + tp, 2 * CHUNK + 7), tokens(91 + tp, 3 * CHUNK)
    a = run_engine(tmp_path, "lmcache", [server.url], [{"requests": [req("l1", p1, "s")]}],
                   tp=tp, mla=True)
    assert loaded(a, "l1") == 0
    b = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("o1", p1, "s"), req("o2", p2, "s")]}], tp=tp, mla=True)
    assert loaded(b, "o1") == 2 * CHUNK, "ours did not load what LMCache's connector stored"
    assert loaded(b, "o2") == 0 and b["stats"]["stored"] == 1
    c = run_engine(tmp_path, "lmcache", [server.url], [{"requests": [req("l2", p2, "s")]}],
                   tp=tp, mla=True)
    assert loaded(c, "l2") == 3 * CHUNK - 1, "LMCache's connector did not load what ours stored"


@newest_only
def test_two_servers(tmp_path: Path) -> None:
    s1 = start_server(*both_modes_args(f"vllma{os.getpid()}"))
    s2 = start_server(*both_modes_args(f"vllmb{os.getpid()}"))
    try:
        p = tokens(31, 2 * CHUNK)
        urls = [s1.url, s2.url]
        run_engine(tmp_path, "ours", urls, [{"requests": [req("m", p)]}], tp=2)
        b = run_engine(tmp_path, "ours", urls, [{"requests": [req("n", p)]}], tp=2)
        assert loaded(b, "n") == 2 * CHUNK - 1
        # Only one server has it (the other restarted empty): the hit is the minimum, 0.
        s2.stop()
        s2.start_again()
        c = run_engine(tmp_path, "ours", urls, [{"requests": [req("o", p)]}], tp=2)
        assert loaded(c, "o") == 0
    finally:
        s1.stop()
        s2.stop()


@wide_only
def test_server_restart_mid_stream(tmp_path: Path) -> None:
    s = start_server(*both_modes_args(f"vllmr{os.getpid()}"))
    try:
        kill = [str(SERVER_SCRIPT), "stop", "--port", str(s.port)]
        start = [str(SERVER_SCRIPT), "start", "--version", SERVER_VERSION, "--port",
                 str(s.port), "--", *s.args]
        p = [tokens(40 + i, 2 * CHUNK + 3) for i in range(6)]
        # Engine 1 stores p0..p2. Engine 2 loads them while the server is stopped at
        # step 1 and started again later: the loads fail and are recomputed, nothing
        # hangs; after recovery the cache works again (p3 stored, then loaded).
        run_engine(tmp_path, "ours", [s.url], [{"requests": [req(f"a{i}", p[i])
                                                             for i in range(3)]}])
        extra = {"lmcache.mp.heartbeat_interval": 1, "lmcache.mp.health_interval": 0.5,
                 "lmcache.mp.transfer_timeout": 5}
        r = run_engine(tmp_path, "ours", [s.url], [
            {"requests": [req(f"b{i}", p[i]) for i in range(3)], "on_step": {"1": kill}},
            {"requests": [req("c0", p[0])], "sleep_after": 0},
            {"requests": [req("w", p[5])], "on_step": {"1": start}, "sleep_after": 4},
            {"requests": [req("c3", p[3])], "sleep_after": 1},
            {"requests": [req("c4", p[3])]},
        ], extra=extra, timeout=300)
        for rid in ("b0", "b1", "b2", "c0", "w", "c3", "c4"):
            assert r["requests"][rid]["verified"], rid
        # b0-b2 lost the server between lookup and load (or before the lookup): they
        # were computed locally, within a few transfer deadlines; nothing hung.
        assert all(loaded(r, f"b{i}") in (0, 2 * CHUNK) for i in range(3))
        assert r["phase_seconds"][0] < 60
        # After recovery the new (empty) server got c3's chunks: a fresh engine loads them.
        assert r["stats"]["stored"] >= 1
        again = run_engine(tmp_path, "ours", [s.url], [{"requests": [req("d3", p[3])]}])
        assert loaded(again, "d3") == 2 * CHUNK
    finally:
        s.stop()


@edge_only
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync_load"])
def test_server_gone_between_lookup_and_load(tmp_path: Path, sync: bool) -> None:
    """The lookup hits; the server is stopped before the workers' RETRIEVE: the load
    fails within its deadline, its blocks go to get_block_ids_with_load_errors, vLLM
    recomputes them (recompute policy) and the request completes with the right bytes;
    nothing hangs. Asynchronous: the request is scheduled once the load failed, from
    the start. ``lmcache.mp.sync_load``: it was scheduled with the hit computed, and
    vLLM rewinds it within the step (its loaded blocks are not checked then)."""
    s = start_server(*both_modes_args(f"vllmg{os.getpid()}"))
    try:
        p = tokens(60, 2 * CHUNK + 9)
        run_engine(tmp_path, "ours", [s.url], [{"requests": [req("a", p)]}])
        stop = [str(SERVER_SCRIPT), "stop", "--port", str(s.port)]
        r = run_engine(tmp_path, "ours", [s.url], [
            {"requests": [req("b", p)], "on_retrieve": stop}],
            extra={"lmcache.mp.transfer_timeout": 5, "lmcache.mp.health_interval": 0.5,
                   "lmcache.mp.sync_load": sync})
        assert r["stats"]["load_errors"] == 1 and r["stats"]["retrieved"] == 0
        b = r["requests"]["b"]
        assert loaded(r, "b") == (2 * CHUNK if sync else 0)  # bytes verified
        assert b["failed_sync_loads"] == int(sync) and b["output_tokens"] > 0, b
        assert "recomputed without the cache" in r["log"]
    finally:
        s.stop()


@edge_only
def test_sync_load_is_in_the_blocks_before_the_forward_pass(server: LiveServer,
                                                            tmp_path: Path) -> None:
    """``lmcache.mp.sync_load``: vLLM's real scheduler schedules the warm request in
    the step that loads it (``(n, False)``), beside a request that computes, and the
    blocks hold the stored bytes when that step's forward pass runs (the harness checks
    them at first scheduling: had ``start_load_kv`` not waited for the load, they would
    still be empty). Stores go on: a third engine loads the one computed beside it."""
    p, q = tokens(70, 3 * CHUNK + 5), tokens(71, 2 * CHUNK + 3)
    run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p)]}])
    sync = {"lmcache.mp.sync_load": True}
    r = run_engine(tmp_path, "ours", [server.url],
                   [{"requests": [req("b", p), req("c", q)]}], extra=sync)
    assert loaded(r, "b") == 3 * CHUNK and loaded(r, "c") == 0
    assert r["stats"]["load_errors"] == 0 and r["stats"]["retrieved"] == 1
    assert r["requests"]["b"]["failed_sync_loads"] == 0
    # Sent in handle_preemptions, before vLLM prepares the step, for a CPU cache (0.32,
    # 0.33); 0.34's harness engines register CUDA caches (the fake driver): not there.
    from tests.integrations.vllm.engines import vllm_version
    assert r["stats"]["early_loads"] == (1 if vllm_version() < (0, 34) else 0)
    again = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("d", q)]}],
                       extra=sync)
    assert loaded(again, "d") == 2 * CHUNK


@edge_only
def test_server_down_from_the_start(tmp_path: Path) -> None:
    from tests.conftest import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    r = run_engine(tmp_path, "ours", [url], [{"requests": [req("z", tokens(50, 600))]}],
                   extra={"lmcache.mp.mq_timeout": 2, "lmcache.mp.health_interval": 0.5})
    assert loaded(r, "z") == 0 and r["stats"]["stored"] == 0


@wide_only
def test_sleep_and_wake_register_again_and_load_again(server: LiveServer,
                                                      tmp_path: Path) -> None:
    """vLLM 0.33+ releases the KV cache's memory on sleep between
    ``unregister_kv_caches`` and ``restore_kv_caches`` (0.34: its extensible cache's
    pages, the same addresses after); the connector unregisters first and registers
    again afterwards under the same instance id; vLLM clears its prefix cache, so the
    next request loads from the server into the new memory, bytes equal (a sleep
    without ``reset_connector``, 0.34's ``LLM.sleep(reset_connector=False)``: the
    weights do not change; with it, test_vllm_034.py's reset test). And vLLM
    accepts ``--enable-sleep-mode`` with the connector (it asks
    ``supports_sleep_mode``: 0.33's refusal before the connector followed sleep)."""
    from tests.integrations.vllm.engines import vllm_python, vllm_version

    if vllm_version() < (0, 33):
        pytest.skip(f"vLLM {'.'.join(map(str, vllm_version()))} has no sleep hooks for "
                    f"connectors (0.33 and 0.34 do: make test runs this under their trees)")
    p = tokens(347, 2 * CHUNK + 7)
    r = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("s", p)], "sleep_wake": True, "reset_connector": False},
        {"requests": [req("l", p)]}])
    assert loaded(r, "s") == 0
    (before, after) = r["instances"][0]
    assert before == after, "registered under a new instance id after waking"
    assert loaded(r, "l") == 2 * CHUNK and r["stats"]["load_errors"] == 0
    proc = subprocess.run([str(vllm_python()), str(HARNESS), "--sleep-mode"],
                          capture_output=True, text=True, timeout=300, env=engine_env(),
                          cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])["--sleep-mode"]
    assert out["refused"] is False, out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
