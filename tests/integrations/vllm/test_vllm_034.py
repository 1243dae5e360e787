"""The connector under vLLM 0.34's real Scheduler and its V2 worker wiring, against a
real LMCache server (``make test``'s ``vllm-tree-0.34`` job: ``.venv-vllm-0.34.0``,
vLLM 0.34.0's Python tree; skipped under another vLLM).

What vLLM 0.34 changed for a connector (compat.py lists it), each driven through
vLLM's own code (``harness.py``; the KV cache is vLLM 0.34's extensible cache, its
own ``pad_kv_cache_segments`` / ``ExtensibleKVCache`` / ``extend_kv_cache`` /
``committed_views`` over host memory: ``extensible.py``):

* store, then a fresh engine loads: the bytes equal, from the padded, per-segment
  views registered at ``extend_kv_cache``;
* a preempted request comes back through ``scheduled_new_reqs`` (whole block table):
  looked up again, loaded, bytes equal;
* a request aborted while its load is pending;
* prompt-logprob requests (``skip_reading_external_kv``) are not looked up;
* sleep / wake: unregistered, the memory released, registered again under the same
  instance id, loaded again (test_vllm_live.py, run here too);
* ``kv_cache_access`` per transfer mode, as vLLM's own config resolution reads it;
* vLLM's ``TokenBuffer`` packed without a Python loop over the tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp import Client, CpuKVCache
from tests.conftest import REPO, SERVER_SCRIPT, SERVER_VERSION, LiveServer, start_server
from tests.integrations.vllm.engines import engine_env, engine_tmpdir, vllm_python, vllm_version
from tests.integrations.vllm.test_vllm_live import CHUNK, loaded, req, run_engine, tokens
from tests.support.live_helpers import both_modes_args

pytestmark = [pytest.mark.live, pytest.mark.skipif(
    os.environ.get("LMCACHE_MP_SKIP_LIVE") == "1", reason="LMCACHE_MP_SKIP_LIVE=1")]

HARNESS = Path(__file__).with_name("harness.py")


@pytest.fixture(scope="module", autouse=True)
def _vllm_034() -> None:
    if vllm_version()[:2] < (0, 34):
        pytest.skip(f"vLLM {'.'.join(map(str, vllm_version()))}: these are vLLM 0.34's "
                    f"(make test runs them under .venv-vllm-0.34.0)")


@pytest.fixture(scope="module")
def server() -> Any:
    s = start_server(*both_modes_args(f"v034{os.getpid()}"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    """``harness.py --kv-cache-access --token-buffer --connector-config --handshake
    --data-parallel`` under the tree's python (one vLLM import for them all): ``{check:
    its result}``."""
    proc = subprocess.run([str(vllm_python()), str(HARNESS), "--kv-cache-access",
                           "--token-buffer", "--connector-config", "--handshake",
                           "--data-parallel"],
                          capture_output=True,
                          text=True, timeout=300,
                          env=engine_env(), cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return dict(json.loads(lines[-1][len("RESULT "):]))


def test_store_then_a_fresh_engine_loads_from_the_extensible_cache(
        server: LiveServer, tmp_path: Path) -> None:
    p = tokens(341, 3 * CHUNK + 40)
    first = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p, "x")]}])
    assert first["vllm"].startswith("0.34")
    assert loaded(first, "a") == 0 and first["stats"]["stored"] == 1
    (view,) = first["views"]
    # vLLM 0.34's extensible cache as extend_kv_cache hands it over: each layer's view
    # its own storage spanning exactly the committed blocks, the layers' regions
    # padded apart to the 2 MiB granule, the final block count registered, once.
    assert view["extensible"] and view["layout"] in ("LBHNC", "LBNHC")
    per_layer = view["num_blocks"] * view["block_bytes"]
    assert view["storage_nbytes"] == [per_layer] * len(view["storage_nbytes"])
    stride = view["data_ptrs"][1] - view["data_ptrs"][0]
    assert stride > per_layer and stride % (2 << 20) == 0
    assert view["registered_blocks"] == view["num_blocks"]
    assert [len(i) for i in first["instances"]] == [1]
    second = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("b", p, "x")]}])
    assert loaded(second, "b") == 3 * CHUNK and second["stats"]["load_errors"] == 0


def test_the_extensible_cache_over_several_chunks_registers_and_moves_bytes_both_ways(
        server: LiveServer, tmp_path: Path) -> None:
    """vLLM 0.34's default cache on a GPU, as its own code commits it (over the fake
    CUDA driver, extensible.py): wide blocks (8 heads of 256: 128 KiB a block, 16 a
    2 MiB granule), so vLLM's minimum commit (the null block), its warm-up commit (24
    blocks) and extend_kv_cache's (96 blocks) each map a cuMemCreate chunk under every
    layer's view: three chunks, which cuMemGetAddressRange answers one at a time. The
    connector registers the views through its CUDA path (engine-driven: the connector
    declared IN_PROCESS), stores a 3-chunk prompt whose blocks lie in all three chunks,
    and a fresh engine loads it back, bytes checked. Before (1470964) the registration
    refused a view spanning chunks and the worker died at start."""
    p = tokens(347, 3 * CHUNK + 40)
    wide = {"kv_heads": 8, "head_dim": 256, "warmup_blocks": 24}
    first = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p, "w")]}],
                       **wide)
    (view,) = first["views"]
    assert view["registered_as"] == "CudaKVCache engine" and view["extensible"]
    assert view["block_bytes"] == 128 << 10 and view["chunks"] == [3, 3]
    assert loaded(first, "a") == 0 and first["stats"]["stored"] >= 1
    second = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("b", p, "w")]}],
                        **wide)
    assert second["views"][0]["chunks"] == [3, 3]
    # 3 chunks of 256 tokens: blocks 1..48 of 16 tokens, over all three VMM chunks.
    assert loaded(second, "b") == 3 * CHUNK and second["stats"]["load_errors"] == 0


def test_a_preempted_request_comes_back_through_scheduled_new_reqs_and_loads(
        server: LiveServer, tmp_path: Path) -> None:
    """Two requests in a cache too small for both to finish decoding (no vLLM prefix
    cache): vLLM preempts one (its blocks freed); 0.34 schedules it again as a new
    request with its whole block table (no ``resumed_req_ids``). It looks its tokens up
    again and loads the chunks it stored before, bytes equal."""
    p, q = tokens(342, 2 * CHUNK + 5), tokens(343, 2 * CHUNK + 5)
    r = run_engine(tmp_path, "ours", [server.url], [{"requests": [
        {**req("p", p), "max_tokens": 230}, {**req("q", q), "max_tokens": 230}]}],
        extra={"lmcache.mp.lookup_wait": 1.0}, num_blocks=80, prefix_caching=False)
    assert r["preemptions"] >= 1
    resumed = {rid: x["resumed"] for rid, x in r["requests"].items() if x["resumed"]}
    assert resumed, f"no request was scheduled again after its preemption: {r['requests']}"
    for rid, computed in resumed.items():
        assert computed[0] >= 2 * CHUNK, (rid, computed)  # its stored prompt chunks
        assert r["requests"][rid]["verified"], f"{rid}: wrong bytes after the reload"
        assert r["lookups"][rid] == 1 + len(computed)  # looked up again each time
    assert r["stats"]["load_errors"] == 0


def test_a_request_aborted_while_its_load_is_pending(server: LiveServer,
                                                    tmp_path: Path) -> None:
    """Aborted in the step it waits for its KV load: vLLM frees it once the load is
    reported, never before (0.34 asserts the request still exists on a report); the
    other request completes, and the engine loads again."""
    p, other = tokens(344, 2 * CHUNK + 9), tokens(345, 2 * CHUNK + 3)
    run_engine(tmp_path, "ours", [server.url], [{"requests": [req("s", p)]}])
    r = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("a", p), req("o", other)], "abort_when_loading": ["a"]},
        {"requests": [req("b", p)]}])
    assert r["requests"]["a"]["aborted"]
    assert loaded(r, "o") == 0
    assert loaded(r, "b") == 2 * CHUNK, "the engine did not load again after the abort"


def test_prompt_logprob_requests_are_not_looked_up(server: LiveServer,
                                                   tmp_path: Path) -> None:
    """vLLM 0.34 discards external hits for a request with prompt logprobs
    (``skip_reading_external_kv``): the connector sends it no LOOKUP (whose read locks
    nothing would free) and it is computed; another request for the same prompt loads."""
    p = tokens(346, 2 * CHUNK + 11)
    run_engine(tmp_path, "ours", [server.url], [{"requests": [req("s", p)]}])
    r = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [{**req("lp", p), "prompt_logprobs": 1}]},
        {"requests": [req("plain", p)]}])
    assert r["lookups"].get("lp", 0) == 0, "a LOOKUP for a request vLLM reads no external KV for"
    assert loaded(r, "lp") == 0
    assert r["lookups"]["plain"] == 1 and loaded(r, "plain") == 2 * CHUNK


def test_kv_cache_access_follows_the_transfer_mode(checks: dict[str, Any]) -> None:
    """What vLLM 0.34 reads from the connector (its own config and factory) and what it
    then allocates: engine-driven and auto keep vLLM's extensible VMM cache
    (IN_PROCESS); LMCache-driven (the server maps the cache through CUDA IPC) declares
    LEGACY_IPC, and vLLM allocates an ordinary cache. A wrong mode is refused when
    vLLM reads its config, naming the key."""
    out = checks["--kv-cache-access"]
    for mode in ("default", "auto", "engine_driven"):
        assert out[mode] == {"access": "IN_PROCESS", "extensible": True}, (mode, out)
    assert out["lmcache_driven"] == {"access": "LEGACY_IPC", "extensible": False}, out
    assert out["wrong"] and "lmcache.mp.mp_transfer_mode" in out["wrong"]


def test_vllms_token_buffer_is_packed_without_a_python_loop(checks: dict[str, Any]) -> None:
    out = checks["--token-buffer"]
    assert out["buffer"] == "vllm.v1.token_buffer.TokenBuffer" and "array" in out["bases"]
    assert out["packed_as"] == "ndarray" and out["same_bytes"]
    assert out["grew_to"] == 5001  # the buffer was not left pinned by an export


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_touches_only_the_blocks_it_was_to_write(
        policy: str, tmp_path: Path) -> None:
    """B runs (decoding) with 288 tokens of its prompt shared with A's; A arrives, vLLM's
    prefix cache covers those 288 tokens, the server holds 768: A's RETRIEVE starts at
    256 and skips 32 tokens (two of B's blocks, computed KV). The server is stopped as
    A's RETRIEVE goes out, so the load fails. Only the blocks it was to write are
    reported: B keeps its computed tokens and blocks and finishes, under both vLLM
    policies (vLLM's own _handle_invalid_blocks scans running requests). Before
    (1470964) B's two shared blocks were reported too: vLLM rewound B to 256 tokens
    (``recompute``) or failed it (``fail``)."""
    s = start_server(*both_modes_args(f"v034f{os.getpid()}"))
    try:
        p = tokens(348, 3 * CHUNK + 40)
        run_engine(tmp_path, "ours", [s.url], [{"requests": [req("s", p)]}])
        b = {**req("b", p[:300] + tokens(349, 20)), "max_tokens": 300}
        stop = [str(SERVER_SCRIPT), "stop", "--port", str(s.port)]
        r = run_engine(tmp_path, "ours", [s.url], [{
            "requests": [b], "later": {"3": [req("a", p)]},
            "on_retrieve_of": {"a": [stop]}, "then_wait": "unhealthy"}],
            extra={"lmcache.mp.heartbeat_interval": 0.5, "lmcache.mp.health_interval": 0.5,
                   "lmcache.mp.mq_timeout": 2, "lmcache.mp.transfer_timeout": 5,
                   "lmcache.mp.lookup_wait": 1.0},
            num_blocks=128, failure_policy=policy)
        assert r["observed"]["running_at_hook"]["a"] == ["b"]  # B runs as A's load fails
        rb, ra = r["requests"]["b"], r["requests"]["a"]
        assert r["stats"]["load_errors"] == 1  # A's; B's own load (256 tokens) succeeded
        assert loaded(r, "b") == CHUNK
        assert rb["rewound"] == 0, "B lost computed tokens to A's failed load"
        assert rb["status"] == "FINISHED_LENGTH_CAPPED" and rb["output_tokens"] == 300
        if policy == "recompute":  # A: its own 288 tokens kept, the rest computed
            assert loaded(r, "a") == 288 and ra["status"] == "FINISHED_LENGTH_CAPPED"
        else:
            assert ra["status"] == "FINISHED_ERROR"
    finally:
        s.stop()


def test_a_preempted_request_whose_load_failed_is_not_looked_up_again(
        server: LiveServer, tmp_path: Path) -> None:
    """This engine's registration is refused while the server answers probes and
    lookups (another replica of the model is registered: the servers answer lookups of
    registered models only): each load fails at once. Two requests with hits, decoding
    in a cache too small for both (vLLM preempts one, ``recompute`` policy): a request
    whose load failed is not looked up again when it is scheduled again, so it does not
    look up, allocate and fail forever; both finish, recomputed, every token's KV
    verified, the reason logged once per request. Before (1470964) the preempted
    request looped until the engine's deadline."""
    p, q = tokens(350, 2 * CHUNK + 5), tokens(351, 2 * CHUNK + 5)
    run_engine(tmp_path, "ours", [server.url], [{"requests": [req("sp", p), req("sq", q)]}])
    with Client(server.url, timeout=10.0) as client:
        replica = client.register(
            CpuKVCache.allocate(num_layers=1, num_blocks=4, block_size=16, num_heads=1,
                                head_dim=8, dtype="float16"),
            model_name=str(engine_tmpdir() / "lmcache_mp_vllm_tiny_llama"), mode="engine")
        try:
            r = run_engine(tmp_path, "ours", [server.url], [{"requests": [
                {**req("p", p), "max_tokens": 230}, {**req("q", q), "max_tokens": 230}]}],
                extra={"lmcache.mp.lookup_wait": 1.0, "lmcache.mp.health_interval": 0.5},
                num_blocks=80, prefix_caching=False, refuse_registration=True,
                timeout=200)
        finally:
            replica.unregister()
    assert r["preemptions"] >= 1
    for rid in ("p", "q"):
        x = r["requests"][rid]
        assert x["verified"] and x["status"] == "FINISHED_LENGTH_CAPPED"
        assert x["output_tokens"] == 230
        assert r["lookups"][rid] == 1, f"{rid} looked up again after its load failed"
        assert r["log"].count(f"request {rid} is recomputed without the cache") == 1
    assert r["stats"]["load_errors"] == 2 and r["stats"]["retrieved"] == 0


def _other_model_entry(client: Client, tokens_: list[int]) -> tuple[Any, Any]:
    """Another model's entry on the same server (its registration kept, as another
    engine's would be: the servers answer lookups of registered models only)."""
    kv = CpuKVCache.allocate(num_layers=1, num_blocks=CHUNK // 16, block_size=16,
                             num_heads=1, head_dim=8, dtype="float16")
    reg = client.register(kv, model_name=f"other-model-{os.getpid()}", mode="engine")
    with reg.request(tokens_) as r:
        assert r.store_async(list(range(CHUNK // 16)), end=CHUNK).result() is True
    return kv, reg


def _found(reg: Any, tokens_: list[int]) -> int:
    with reg.request(tokens_) as r:
        return int(r.lookup_async(timeout=10).result())


def test_reset_cache_on_sleep_and_a_weights_version(server: LiveServer,
                                                    tmp_path: Path) -> None:
    """``LLM.sleep(reset_connector=True)`` (vLLM's default; RL rollouts update the
    weights before waking): vLLM's own reset path calls the connector's
    ``reset_cache``; after it this engine never loads what was stored before (the
    old weights' KV): the same prompt is computed, stored under the reset's
    generation, and loaded from that afterwards. A fresh engine started with new
    weights says so with ``lmcache.mp.weights_version``, which enters the key: it
    misses the old entries, loads its own version's, and an engine of another
    version (or none) does not see them. Another model's entry on the same server is
    untouched (nothing is deleted; ``clear_on_reset`` would). Before (1470964) the
    connector had no ``reset_cache`` (vLLM took None for success) and loaded the old
    weights' KV after waking; the version key was refused as unknown."""
    p = tokens(352, 2 * CHUNK + 7)
    with Client(server.url, timeout=10.0) as client:
        kv, other = _other_model_entry(client, tokens(353, CHUNK))
        try:
            r = run_engine(tmp_path, "ours", [server.url], [
                {"requests": [req("s", p)], "sleep_wake": True},
                {"requests": [req("l", p)]}, {"requests": [req("m", p)]}])
            assert loaded(r, "s") == 0
            assert loaded(r, "l") == 0, "loaded the KV stored before the reset"
            assert loaded(r, "m") == 2 * CHUNK  # what was stored after it
            v2 = {"lmcache.mp.weights_version": "v2"}
            a = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("a", p)]}],
                           extra=v2)
            assert a["model"].endswith("##weights-v2") and loaded(a, "a") == 0
            b = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("b", p)]}],
                           extra=v2)
            assert loaded(b, "b") == 2 * CHUNK  # its own version's entries
            c = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("c", p)]}],
                           extra={"lmcache.mp.weights_version": "v3"})
            assert loaded(c, "c") == 0
            assert _found(other, tokens(353, CHUNK)) == CHUNK, "another model's entry went"
        finally:
            other.unregister()


def test_clear_on_reset_drops_every_models_entries(tmp_path: Path) -> None:
    """``lmcache.mp.clear_on_reset``: the reset also sends CLEAR to every server,
    which drops every model's unlocked entries there, this engine's and others'
    (what LMCache's own connector does on every reset)."""
    s = start_server(*both_modes_args(f"v034c{os.getpid()}"))
    try:
        p = tokens(354, 2 * CHUNK + 7)
        with Client(s.url, timeout=10.0) as client:
            kv, other = _other_model_entry(client, tokens(355, CHUNK))
            try:
                r = run_engine(tmp_path, "ours", [s.url], [
                    {"requests": [req("s", p)], "sleep_wake": True}],
                    extra={"lmcache.mp.clear_on_reset": True})
                assert loaded(r, "s") == 0
                assert _found(other, tokens(355, CHUNK)) == 0
            finally:
                other.unregister()
        again = run_engine(tmp_path, "ours", [s.url], [{"requests": [req("t", p)]}])
        assert loaded(again, "t") == 0  # the engine's own entries went too
    finally:
        s.stop()


def test_the_chunks_of_a_failed_load_are_stored_again_by_the_request(tmp_path: Path) -> None:
    """The server restarts (empty) as A's RETRIEVE goes out: the load fails, vLLM keeps
    A's own 288 computed tokens (shared with B) and recomputes the rest, and A stores
    the chunks it was to load on the new server as it computes them. Then an engine
    that stores P's first chunk again loads all three. Before (1470964) A counted
    them stored at its lookup: the new server never got them (only the first chunk
    was found)."""
    s = start_server(*both_modes_args(f"v034s{os.getpid()}"))
    try:
        p = tokens(356, 3 * CHUNK + 40)
        run_engine(tmp_path, "ours", [s.url], [{"requests": [req("s", p)]}])
        stop = [str(SERVER_SCRIPT), "stop", "--port", str(s.port)]
        start = [str(SERVER_SCRIPT), "start", "--version", SERVER_VERSION, "--port",
                 str(s.port), "--", *s.args]
        r = run_engine(tmp_path, "ours", [s.url], [{
            "requests": [{**req("b", p[:300] + tokens(357, 20)), "max_tokens": 40}],
            "later": {"3": [req("a", p)]}, "on_retrieve_of": {"a": [stop, start]},
            "then_wait": "usable"}],
            extra={"lmcache.mp.transfer_timeout": 10, "lmcache.mp.heartbeat_interval": 0.5,
                   "lmcache.mp.health_interval": 0.5, "lmcache.mp.lookup_wait": 1.0},
            num_blocks=128)
        assert r["stats"]["load_errors"] == 1 and loaded(r, "a") == 288
        again = run_engine(tmp_path, "ours", [s.url], [
            {"requests": [req("c", p[:300])]}, {"requests": [req("d", p)]}])
        assert loaded(again, "c") == 0  # the new server had no first chunk: c stores it
        assert loaded(again, "d") == 3 * CHUNK, "A's recomputed chunks never reached the server"
    finally:
        s.stop()


def test_the_rest_of_0_34s_connector_api_on_its_scheduler(server: LiveServer,
                                                          tmp_path: Path) -> None:
    """What vLLM 0.34's scheduler asks the connector beyond the transfers, on its own
    Scheduler with KV events on, stats on and ``--max-num-inflight-kv-loads 2``:

    * ``requires_kv_delivery`` False (a best-effort cache; vLLM's default, True for
      ``kv_both``, drops a preempted request's in-flight output);
    * ``may_load_async``: a request with a hit is admitted through vLLM's async-load
      queue, one that reads no external KV (prompt logprobs) through the plain queue;
    * ``has_pending_block_frees`` True exactly while finished requests' blocks are
      held for their stores, at every step;
    * KV events: vLLM publishes ``BlockStored`` on medium ``CPU`` for the stored
      chunks' blocks, under the very hashes of its own ``GPU`` events for them;
    * hits labelled ``host``.
    Before (1470964): delivery True, both requests in the plain queue, pending frees
    never reported, no CPU events, hits ``external_unspecified``. A request whose
    lookup finds nothing goes through the plain queue (review F7: before, 4549dee,
    every request of a chunk or more was admitted as an async load before its answer
    was in, holding vLLM's other async loads back); the CPU events carry vLLM's group
    (review F10: none before)."""
    p = tokens(358, 2 * CHUNK + 9)
    wait = {"lmcache.mp.lookup_wait": 1.0}  # the answer within the admission's wait
    first = run_engine(tmp_path, "ours", [server.url], [{"requests": [req("s", p)]}],
                       observe=True, extra=wait)
    r = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("l", p), {**req("lp", p), "prompt_logprobs": 1},
                      req("miss", tokens(359, 2 * CHUNK + 9))]}], observe=True, extra=wait)
    for seen in (first["observed"], r["observed"]):
        assert seen["requires_kv_delivery"] is False
        assert seen["pending_wrong"] == 0 and seen["pending_frees"][1] >= 1
    seen = first["observed"]
    gpu = {h for e in seen["events"] if e["type"] == "BlockStored" and e["medium"] == "GPU"
           for h in e["hashes"]}
    cpu = [e for e in seen["events"] if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    stored = [h for e in cpu for h in e["hashes"]]
    assert len(stored) == 2 * CHUNK // 16 and set(stored) <= gpu  # s's two chunks
    assert {e["group_idx"] for e in cpu} == {0}
    seen = r["observed"]
    assert (seen["queues"]["l"], seen["queues"]["lp"]) == ("async_kv_waiting", "waiting")
    assert seen["queues"]["miss"] == "waiting"
    assert loaded(r, "l") == 2 * CHUNK
    assert [h for h in seen["hit_sources"] if h] == [{"host": 2 * CHUNK}]


def test_pcp_is_refused_and_a_drafters_layers_are_keyed_apart(checks: dict[str, Any]) -> None:
    """Prefill-context parallelism is refused when vLLM creates the connector, saying
    what to set; a speculative method with KV layers of its own (EAGLE, MTP, a draft
    model) keys the objects apart (its layers are registered with the model's), one
    without (n-gram) does not. Before (1470964): PCP accepted (each PCP rank stored a
    copy of its own), the drafter's layers under the model's plain key."""
    out = checks["--connector-config"]
    assert "--prefill-context-parallel-size 1" in out["pcp"], out
    assert out["draft_model"].endswith("##draft-draft_model-" + out["model"]), out
    assert out["ngram"] == out["model"], out


def test_the_protocol_family_is_handed_over_only_by_a_top_level_connector(
        checks: dict[str, Any]) -> None:
    """Issue 37's hand-off (the workers' protocol family, for the scheduler) rides on
    vLLM's handshake metadata, of which a MultiConnector forwards only its first
    sub-connector's that is not None, to every sub-connector's scheduler (NIXL's
    refuses any other): inside one, ours hands over nothing. Its sub-connectors'
    configs carry their own class names, so the previous guard (the config's
    kv_connector) handed it over there too."""
    got = checks["--handshake"]
    assert got["alone"] == {"tcp://127.0.0.1:9": "0.5.7"}
    assert got["in_multi"] is None and got["no_group"] is None


def test_no_idle_wait_under_data_parallelism(checks: dict[str, Any]) -> None:
    """A step that schedules no tokens lets the workers wait for their loads (issue 38:
    a warm request's load reported in its own step), but not under data parallelism
    (review F5): an idle DP rank runs a dummy batch right after such a step (vLLM 0.34
    ``engine/core.py``), whose collectives every other rank's forward pass waits for.
    Read from vLLM's own config through its factory. Before (4549dee) the wait was
    allowed under DP too."""
    got = checks["--data-parallel"]
    assert got["dp1"] == {"data_parallel_size": 1, "idle": True}
    assert got["dp2"] == {"data_parallel_size": 2, "idle": False}


def test_a_lora_adapters_kv_is_keyed_apart(server: LiveServer, tmp_path: Path) -> None:
    """vLLM keys a LoRA adapter's blocks apart from the base model's (its name and path
    are in vLLM's block hashes): so do the connector's keys (review F3). On vLLM's
    scheduler with its own ``LoRARequest``s: the base model's chunks stored, an
    adapter request for the same prompt misses, another request of that adapter (a
    reload: another id, the same name and path) loads what the first stored, another
    adapter misses, the base model loads its own. Before (1470964, 4549dee) the
    adapter request loaded the base model's KV."""
    p = tokens(360, 2 * CHUNK + 7)
    a = {"name": "adapter-a", "id": 1, "path": "/adapters/a"}
    r = run_engine(tmp_path, "ours", [server.url], [
        {"requests": [req("s", p)]},
        {"requests": [{**req("a1", p), "lora": a}]},
        {"requests": [{**req("a2", p), "lora": {**a, "id": 2}}]},
        {"requests": [{**req("b", p), "lora": {"name": "adapter-b", "id": 3,
                                                "path": "/adapters/b"}}]},
        {"requests": [req("base", p)]}], prefix_caching=False)
    assert loaded(r, "s") == 0
    assert loaded(r, "a1") == 0, "an adapter request loaded the base model's KV"
    assert loaded(r, "a2") == 2 * CHUNK and loaded(r, "b") == 0
    assert loaded(r, "base") == 2 * CHUNK
