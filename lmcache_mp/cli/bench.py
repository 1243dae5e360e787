"""``lmcache-mp bench URL``: the client-side benchmark against any server.

Contenders take turns in every round (their order reverses each round, so machine
noise hits them alike): this client, a bare pyzmq DEALER (the control-plane floor),
a single-core ``np.copyto`` of the same bytes (the memory floor of a transfer), and
any others passed in (``benchmarks/compare.py`` adds LMCache's own client). Round 0
is a warm-up and is not reported; medians of the rest, and ratios, are. Measures:

* ``noop_us``: mean NOOP round trip; ``pipelined_krps``: NOOPs with 2000 in flight;
  ``lookup_us``: LOOKUP + WAIT of a 4096-token prompt.
* ``request_cpu_us.{store,retrieve}``: client CPU (every thread of this process) per
  LMCache-driven STORE / RETRIEVE of 4096 tokens and 256 block ids, on a tiny cache
  so the server's copy is short; ``ours`` passes a list of ids, ``ours_numpy`` an array.
* ``gbps.<mode>.<layout>.{store,retrieve}``: KV bytes of a 4096-token key (8 layers x
  8 heads x 128, bf16: 128 MiB) / seconds of the blocking call; ``engine`` mode is
  this client's copy, ``lmcache`` mode the server's. Bytes are checked after the
  warm-up and the last round.
* ``import_ms``: ``import lmcache_mp`` in a fresh interpreter, less a bare one.
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..client import Client
from ..errors import InvalidArgument
from ..ipc.cpu_cache import CpuKVCache
from ..keys import CacheKey

__all__ = ["Contender", "Ours", "Bare", "Memcpy", "Config", "run"]

Sample = float | None


class Config:
    def __init__(self, *, rounds: int = 5, quick: bool = False) -> None:
        self.rounds = rounds
        q = quick  # a smoke run: everything once, small
        self.tokens, self.layers, self.heads, self.head_dim = 4096, (2 if q else 8), (2 if q else 8), 128
        self.block_size, self.dtype = 16, "bfloat16"
        self.calls, self.pipeline, self.lookups, self.requests = ((50, 100, 10, 4) if q
                                                                   else (1000, 2000, 200, 16))
        self.key_bytes = self.tokens * self.layers * 2 * self.heads * self.head_dim * 2

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class Contender:
    """One side of the comparison; a measure it does not take returns None."""

    name = "?"

    def noop_us(self, n: int) -> Sample:
        return None

    def pipelined_krps(self, n: int) -> Sample:
        return None

    def lookup_us(self, n: int) -> Sample:
        return None

    def request_cpu_us(self, op: str, k: int) -> Sample:
        return None

    def transfer(self, mode: str, layout: str, verify: bool) -> tuple[Sample, Sample]:
        return None, None

    def import_ms(self) -> Sample:
        return None

    def close(self) -> None:
        pass


def tokens(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng().integers(0, 2**31, n).tolist()  # type: ignore[no-any-return]


def wait_visible(lookup: Callable[[], int], want: int, free: Callable[[int], None]) -> None:
    """LOOKUP until ``want`` chunks hit (a STORE's chunks show up shortly after its
    reply); partial hits are released. The last lookup's locks stay for the RETRIEVE."""
    deadline = time.monotonic() + 10.0
    while (hits := lookup()) < want:
        if hits:
            free(hits)
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {hits}/{want} chunks visible after 10 s")
        time.sleep(0.002)


class Ours(Contender):
    """This client: registrations per (mode, layout), made on first use."""

    name = "ours"

    def __init__(self, url: str, cfg: Config, *, numpy_ids: bool = False) -> None:
        self.cfg, self.numpy_ids = cfg, numpy_ids
        self.name = "ours_numpy" if numpy_ids else "ours"
        self.client = Client(url, timeout=30.0)
        self.chunk = self.client.chunk_size()
        self.regs: dict[tuple[str, str, bool], Any] = {}

    def _reg(self, mode: str, layout: str, tiny: bool = False) -> Any:
        k = (mode, layout, tiny)
        if k not in self.regs:
            c = self.cfg
            per = c.tokens // c.block_size
            kv = CpuKVCache.allocate(
                num_layers=1 if tiny else c.layers, num_blocks=2 * per,
                block_size=c.block_size, num_heads=1 if tiny else c.heads,
                head_dim=8 if tiny else c.head_dim, dtype=c.dtype, layout=layout)  # type: ignore[arg-type]
            for layer in kv.layers:
                layer.view("uint8")[...] = 7
            try:
                reg = self.client.register(kv, model_name=f"bench-{uuid.uuid4().hex[:8]}",
                                           mode=mode)
            except BaseException:
                kv.close()
                raise
            self.regs[k] = reg
        return self.regs[k]

    def noop_us(self, n: int) -> Sample:
        if self.numpy_ids:  # this variant only differs in its requests' block ids
            return None
        noop = self.client.noop
        start = time.perf_counter()
        for _ in range(n):
            noop()
        return (time.perf_counter() - start) / n * 1e6

    def pipelined_krps(self, n: int) -> Sample:
        if self.numpy_ids:
            return None
        start = time.perf_counter()
        futures = [self.client.noop_async() for _ in range(n)]
        for f in futures:
            f.result()
        return n / (time.perf_counter() - start) / 1e3

    def lookup_us(self, n: int) -> Sample:
        if self.numpy_ids:
            return None
        toks = tokens(self.cfg.tokens)
        keys = [CacheKey(model_name="bench", world_size=1, worker_id=None, token_ids=toks,
                         start=0, end=len(toks), request_id=uuid.uuid4().hex) for _ in range(n)]
        start = time.perf_counter()
        for key in keys:
            self.client.lookup(key)
        return (time.perf_counter() - start) / n * 1e6

    def _keys(self, reg: Any, n: int) -> list[CacheKey]:
        t = self.cfg.tokens
        return [CacheKey(model_name=reg.model_name, world_size=1, worker_id=0,
                         token_ids=tokens(t), start=0, end=t, request_id=uuid.uuid4().hex)
                for _ in range(n)]

    def _visible(self, key: CacheKey) -> None:
        look = CacheKey(model_name=key.model_name, world_size=1, worker_id=None,
                        token_ids=key.token_ids, start=0, end=key.end, request_id=key.request_id)
        wait_visible(lambda: self.client.lookup(look), key.end // self.chunk,  # chunks
                     lambda h: self.client.free_lookup_locks(look.with_range(0, h * self.chunk)))

    def request_cpu_us(self, op: str, k: int) -> Sample:
        import numpy as np

        reg = self._reg("lmcache", "HND", tiny=True)
        per = self.cfg.tokens // self.cfg.block_size
        src: Any = np.arange(1, per + 1) if self.numpy_ids else list(range(1, per + 1))
        dst: Any = (np.arange(per, 2 * per) if self.numpy_ids else list(range(per, 2 * per)))
        keys = self._keys(reg, k)
        cpu = 0.0
        for key in keys:
            t = time.process_time()
            reg.store(key, src)
            if op == "store":
                cpu += time.process_time() - t
        for key in keys:
            self._visible(key)
            t = time.process_time()
            reg.retrieve(key, dst)
            if op == "retrieve":
                cpu += time.process_time() - t
            self.client.end_session(key.request_id)
        return cpu / k * 1e6

    def transfer(self, mode: str, layout: str, verify: bool) -> tuple[Sample, Sample]:
        if self.numpy_ids:
            return None, None
        try:
            reg = self._reg(mode, layout)
        except InvalidArgument:
            return None, None  # LMCache-driven NHD on a 0.5.3 / 0.5.4 server: refused

        if reg.mode != mode:
            return None, None  # e.g. a server without an L1 pool: no engine-driven mode
        kv = reg.cache
        per = self.cfg.tokens // self.cfg.block_size
        src, dst = list(range(per)), list(range(per, 2 * per))
        key = self._keys(reg, 1)[0]
        if verify:
            import numpy as np

            rng = np.random.default_rng()
            for layer in kv.layers:
                raw = layer.view("uint8")
                raw[:, :per] = rng.integers(0, 256, raw[:, :per].shape, dtype="uint8")
                raw[:, per:] = 0
        t = time.perf_counter()
        ok = reg.store(key, src)
        t_store = time.perf_counter() - t
        self._visible(key)
        t = time.perf_counter()
        ok = reg.retrieve(key, dst) and ok
        t_retrieve = time.perf_counter() - t
        self.client.end_session(key.request_id)
        if not ok:
            raise RuntimeError(f"ours {mode} {layout}: a transfer failed")
        if verify and not all((layer[:, :per] == layer[:, per:]).all() for layer in kv.layers):
            raise RuntimeError(f"ours {mode} {layout}: retrieved bytes differ from stored")
        return self.cfg.key_bytes / t_store / 1e9, self.cfg.key_bytes / t_retrieve / 1e9

    def import_ms(self) -> Sample:
        if self.numpy_ids:
            return None
        def once(code: str) -> float:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            return time.perf_counter() - t

        bare = statistics.median(once("pass") for _ in range(3))
        return (statistics.median(once("import lmcache_mp") for _ in range(3)) - bare) * 1e3

    def close(self) -> None:
        for reg in self.regs.values():
            reg.unregister()
            reg.cache.close()
        self.client.close()


class Bare(Contender):
    """A bare pyzmq DEALER: the floor for a NOOP round trip."""

    name = "bare"

    def __init__(self, url: str) -> None:
        import msgspec
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.uid = iter(range(1 << 62))
        self.encode = msgspec.msgpack.encode
        self.noop_frame = msgspec.msgpack.encode(24)  # NOOP

    def noop_us(self, n: int) -> Sample:
        send, recv, enc, uid, frame = (self.sock.send_multipart, self.sock.recv_multipart,
                                       self.encode, self.uid, self.noop_frame)
        start = time.perf_counter()
        for _ in range(n):
            send([enc(next(uid)), frame])
            recv()
        return (time.perf_counter() - start) / n * 1e6

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class Memcpy(Contender):
    """One core's ``np.copyto`` of a key's bytes: what a transfer is measured against."""

    name = "memcpy"

    def __init__(self, cfg: Config) -> None:
        import numpy as np

        self.a = np.full(cfg.key_bytes, 3, dtype=np.uint8)
        self.b = np.ones(cfg.key_bytes, dtype=np.uint8)
        self.nbytes = cfg.key_bytes

    def transfer(self, mode: str, layout: str, verify: bool) -> tuple[Sample, Sample]:
        if mode != "engine":
            return None, None
        import numpy as np

        out = []
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            t = time.perf_counter()
            np.copyto(dst, src)
            out.append(self.nbytes / (time.perf_counter() - t) / 1e9)
        return out[0], out[1]


#: (mode, layout) of the transfer measures; LMCache-driven NHD needs 0.5.5+ servers.
TRANSFERS = (("engine", "HND"), ("engine", "NHD"), ("lmcache", "HND"), ("lmcache", "NHD"))


def plan(cfg: Config) -> list[tuple[str, Callable[[Contender, bool], dict[str, Sample]]]]:
    """Each measure of a round: its label and how a contender takes it."""
    steps: list[tuple[str, Callable[[Contender, bool], dict[str, Sample]]]] = [
        ("noop", lambda c, v: {"noop_us": c.noop_us(cfg.calls)}),
        ("pipelined", lambda c, v: {"pipelined_krps": c.pipelined_krps(cfg.pipeline)}),
        ("lookup", lambda c, v: {"lookup_us": c.lookup_us(cfg.lookups)}),
        ("request cpu", lambda c, v: {
            "request_cpu_us.store": c.request_cpu_us("store", cfg.requests),
            "request_cpu_us.retrieve": c.request_cpu_us("retrieve", cfg.requests)}),
    ]
    for mode, layout in TRANSFERS:
        def step(c: Contender, v: bool, mode: str = mode, layout: str = layout
                 ) -> dict[str, Sample]:
            s, r = c.transfer(mode, layout, v)
            return {f"gbps.{mode}.{layout}.store": s, f"gbps.{mode}.{layout}.retrieve": r}
        steps.append((f"{mode} {layout}", step))
    steps.append(("import", lambda c, v: {"import_ms": c.import_ms()}))
    return steps


def run(contenders: Sequence[Contender], cfg: Config, *, clear: Callable[[], None],
        progress: Callable[[int, int, str], None]) -> dict[str, dict[str, list[float]]]:
    """Every measure of every contender, ``cfg.rounds`` times after a warm-up round:
    ``{measure: {contender: [samples]}}``."""
    samples: dict[str, dict[str, list[float]]] = {}
    steps = plan(cfg)
    total, done = (cfg.rounds + 1) * len(steps) * len(contenders), 0
    for r in range(cfg.rounds + 1):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        verify = r in (0, cfg.rounds)
        for label, step in steps:
            for c in order:
                progress(done, total, f"round {r}/{cfg.rounds} {label}: {c.name}")
                if label.startswith(("engine", "lmcache")):
                    clear()  # each transfer into an empty L1: nothing is evicted
                gc.collect()
                for measure, value in step(c, verify).items():
                    if value is not None and r > 0:
                        samples.setdefault(measure, {}).setdefault(c.name, []).append(value)
                done += 1
    progress(total, total, "done")
    return samples


def main(url: str | None, *, rounds: int = 5, quick: bool = False, json_path: str | None = None,
         png_path: str | None = None, show_progress: bool = True,
         extra: Callable[[str, Config], list[Contender]] | None = None,
         chart_from: str | None = None) -> int:
    """Run the comparison against ``url`` (or only draw ``chart_from``'s JSON); print the
    table; write the JSON and the PNG when asked. ``extra`` adds contenders."""
    import json

    from . import bench_report

    if chart_from is not None:
        if png_path is None:
            raise SystemExit("--chart needs --png PATH")
        bench_report.chart(json.loads(open(chart_from).read()), png_path)
        print(f"chart written to {png_path}")
        return 0
    if url is None:
        raise SystemExit("lmcache-mp bench: give the server URL (or --chart JSON)")
    cfg = Config(rounds=rounds, quick=quick)
    contenders: list[Contender] = []
    try:
        ours = Ours(url, cfg)
        contenders += [ours, Ours(url, cfg, numpy_ids=True), Bare(url), Memcpy(cfg)]
        if extra is not None:
            contenders += extra(url, cfg)
        samples = run(contenders, cfg, clear=lambda: ours.client.clear(),
                      progress=bench_report.Progress(show_progress))
        result = {"server": url, "protocol": ours.client.server_protocol,
                  "machine": bench_report.machine(), "config": cfg.as_dict(),
                  "contenders": [c.name for c in contenders], "samples": samples,
                  **bench_report.summarize(samples)}
    finally:
        for c in contenders:
            c.close()
    print(f"lmcache-mp bench {url} (LMCache {result['protocol']} protocol), {cfg.rounds} "
          f"interleaved rounds after a warm-up, medians; {result['machine']['cores']} cores, "
          f"{result['machine']['date']}")
    print(bench_report.table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"raw per-round numbers: {json_path}")
    if png_path:
        bench_report.chart(result, png_path)
        print(f"chart: {png_path}")
    return 0
