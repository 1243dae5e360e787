"""``lmcache-mp``: ping a server, show what it answers, or show the keys it derives.

    lmcache-mp ping URL            is the server answering?
    lmcache-mp info URL            chunk size, protocol, round-trip time, features
    lmcache-mp keys --model M ...  the chunk hashes / storage keys a prompt maps to
    lmcache-mp doctor [URL]        CUDA, IPC, memory, /dev/shm, the server: which modes work
                                   (--peer URL, --server-log FILE: the shared L2 tier)
    lmcache-mp clean [--dry-run]   remove the shared memory of killed lmcache_mp processes
                                   (also: lmcache-mp doctor --clean)
    lmcache-mp bench URL           latency, client CPU and GB/s against a bare DEALER and
                                   memcpy (table, --json, --png; see benchmarks/README.md)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence

from ..client import Client
from ..errors import LMCacheMPError
from ..keys import CacheKey
from ..protocol.hashing import DEFAULT_CHUNK_SIZE, object_keys

__all__ = ["main"]

_ALLOW_REMOTE = ("allow a non-loopback tcp:// host (REGISTER sends pickles over plaintext "
                 "ZMQ with no authentication: trusted networks only)")


_PROTOCOL = ("the server's wire family: auto (probe it: leaves an ERROR line or two in the "
             "server's log on some releases) or 0.5.3 (also 0.5.4) / 0.5.5 / 0.5.6 / 0.5.7 "
             "(`lmcache-mp info URL` prints it)")


def _cmd_ping(args: argparse.Namespace) -> int:
    with Client(args.url, timeout=args.timeout, protocol=args.protocol,
                allow_remote=args.allow_remote) as client:
        start = time.perf_counter()
        client.ping()  # includes connecting
        first = time.perf_counter()
        client.ping()
        done = time.perf_counter()
    print(f"{args.url}: PING answered (connect + first PING {(first - start) * 1e3:.2f} ms, "
          f"round trip {(done - first) * 1e3:.2f} ms)")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    with Client(args.url, timeout=args.timeout, protocol=args.protocol,
                allow_remote=args.allow_remote) as client:
        noop = client.noop()
        chunk = client.chunk_size()
        features = client.get_experimental()
        samples = []
        for _ in range(args.samples):
            start = time.perf_counter()
            client.noop()
            samples.append((time.perf_counter() - start) * 1e6)
        samples.sort()
        detection = client.detection
        how = (f"detected: {'; '.join(detection.evidence)}" if detection is not None
               else "named")
        rows = [
            ("server", args.url),
            ("protocol", f"{client.server_protocol} (LMCache {', '.join(client.profile.releases)}"
                         f"; {how})"),
            ("NOOP", repr(noop)),
            ("chunk size", f"{chunk} tokens"),
            ("experimental", ", ".join(features) or "(none)"),
            ("round trip", f"median {statistics.median(samples):.0f} us, "
                           f"p99 {samples[int(len(samples) * 0.99) - 1]:.0f} us "
                           f"({len(samples)} NOOPs)"),
        ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if detection is not None:
        print(naming_advice(args.url, client.server_protocol))
    return 0


def naming_advice(url: str, family: str) -> str:
    """How to name ``family`` in each entry point, so that no process probes the
    server (each probe leaves ERROR lines in its log on some releases)."""
    return (
        f"\nEvery process that connects with protocol=auto probes the server again (on some\n"
        f"releases each probe leaves ERROR lines with tracebacks in its log). To skip the\n"
        f"probe, name the family:\n"
        f"  Python  Client({url!r}, protocol={family!r})\n"
        f"  vLLM    \"kv_connector_extra_config\": {{\"lmcache.mp.protocol\": \"{family}\", ...}}\n"
        f"  CLI     lmcache-mp info {url} --protocol {family}")


def _read_tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        return [int(t) for t in args.tokens.replace(",", " ").split()]
    if args.tokens_file is not None:
        text = open(args.tokens_file).read()
        stripped = text.strip()
        if stripped.startswith("["):
            return [int(t) for t in json.loads(stripped)]
        return [int(t) for t in stripped.replace(",", " ").split()]
    rng = random.Random(args.seed)
    return [rng.randrange(0, 32000) for _ in range(args.random)]


def _cmd_keys(args: argparse.Namespace) -> int:
    tokens = _read_tokens(args)
    chunk = args.chunk_size
    if args.url:
        with Client(args.url, timeout=args.timeout, protocol=args.protocol,
                    allow_remote=args.allow_remote) as client:
            chunk = client.chunk_size()
    # Validate exactly as a request would be (salt, model name, token range).
    key = CacheKey(model_name=args.model, world_size=args.world_size, worker_id=args.worker_id,
                   token_ids=tokens, start=0, end=len(tokens), request_id="keys",
                   cache_salt=args.salt)
    keys = object_keys(key.token_ids, model_name=key.model_name, world_size=key.world_size,
                       worker_id=key.worker_id, cache_salt=key.cache_salt, chunk_size=chunk)
    print(f"model={key.model_name!r} world_size={key.world_size} salt={key.cache_salt!r} "
          f"chunk_size={chunk} tokens={len(tokens)} complete_chunks={len(tokens) // chunk}")
    if len(tokens) % chunk:
        print(f"(the last {len(tokens) % chunk} tokens form a partial chunk: never stored "
              f"or looked up)")
    print(f"{'chunk':>5}  {'tokens':>13}  {'rank':>4}  {'kv_rank':>10}  chunk_hash (blake3)")
    for k in keys:
        lo = k.chunk_index * chunk
        print(f"{k.chunk_index:>5}  {lo:>6}-{lo + chunk:<6}  {k.rank:>4}  {k.kv_rank:>#10x}  "
              f"{k.chunk_hash.hex()}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from ..ipc.shm import SHM_DIR, sweep_dead_segments

    swept = sweep_dead_segments(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in swept.removed:
        print(f"{verb} {SHM_DIR}/{name}")
    print(f"{verb} {len(swept.removed)} segment(s) of dead lmcache_mp processes "
          f"({swept.freed_bytes / 2**20:.1f} MiB); kept {swept.kept_alive} of live ones")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    args.url = args.url or args.url_pos
    if args.clean:
        _cmd_clean(argparse.Namespace(dry_run=False))
    from .doctor import main_doctor  # imports CUDA bindings only when asked

    return main_doctor(args.url, args.timeout, args.engine_fraction, peer=args.peer,
                       server_logs=args.server_log, l2_wait=args.l2_wait,
                       allow_remote=args.allow_remote, status_urls=args.status)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main  # numpy, and matplotlib for --png, only here

    return bench_main(args.url, rounds=args.rounds, quick=args.quick, json_path=args.json,
                      png_path=args.png, show_progress=not args.no_progress,
                      chart_from=args.chart)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache-mp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ping", help="is the server answering?")
    p.add_argument("url")
    p.add_argument("--protocol", default="auto", help=_PROTOCOL)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--allow-remote", action="store_true", help=_ALLOW_REMOTE)
    p.set_defaults(func=_cmd_ping)

    p = sub.add_parser("info", help="chunk size, protocol, round-trip time")
    p.add_argument("url")
    p.add_argument("--protocol", default="auto", help=_PROTOCOL)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--allow-remote", action="store_true", help=_ALLOW_REMOTE)
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("keys", help="the chunk hashes and storage keys a prompt maps to")
    p.add_argument("--model", required=True)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--worker-id", type=int, default=None,
                   help="one KV rank (default: all ranks, as LOOKUP does)")
    p.add_argument("--salt", default="")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--url", help="ask this server for its chunk size")
    p.add_argument("--protocol", default="auto", help=_PROTOCOL)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--allow-remote", action="store_true", help=_ALLOW_REMOTE)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="token ids, comma or space separated")
    src.add_argument("--tokens-file", help="a JSON list or whitespace-separated token ids")
    src.add_argument("--random", type=int, help="this many random token ids")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_keys)

    p = sub.add_parser("doctor", help="CUDA, IPC handles, memory, /dev/shm, the server: "
                                      "which transfer modes work, mode and L1 advice")
    p.add_argument("url_pos", nargs="?", metavar="URL", help="also check this server")
    p.add_argument("--url", help="also check this server")
    p.add_argument("--engine-fraction", type=float, default=0.9,
                   help="the engine's share of GPU memory (vLLM --gpu-memory-utilization, "
                        "default 0.9) for the L1 size advice on unified memory")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--clean", action="store_true",
                   help="first remove the shared memory of killed lmcache_mp processes")
    p.add_argument("--peer", metavar="URL",
                   help="another node's server sharing this one's L2 tier: compare chunk "
                        "sizes and store a probe chunk here that the peer must find")
    p.add_argument("--l2-wait", type=float, default=10.0,
                   help="how long the peer may take to see the probe (default 10 s)")
    p.add_argument("--server-log", action="append", default=[], metavar="FILE",
                   help="an LMCache server's log: report its L2 adapters' failures "
                        "(repeatable)")
    p.add_argument("--status", action="append", default=[], metavar="HTTP_URL",
                   help="an LMCache server's HTTP front (http://HOST:PORT): its /status "
                        "(health, chunk size, hash algorithm, L2 adapters), compared "
                        "between the nodes given (repeatable)")
    p.add_argument("--allow-remote", action="store_true", help=_ALLOW_REMOTE)
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("bench", help="benchmark this client against a server (table, JSON, PNG)")
    p.add_argument("url", nargs="?", help="the server (its L1 pool enables engine-driven runs)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up")
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes")
    p.add_argument("--json", help="write the raw per-round numbers here")
    p.add_argument("--png", help="draw the chart here (needs the 'bench' extra: matplotlib)")
    p.add_argument("--chart", metavar="JSON", help="only draw --png from an earlier --json")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("clean", help="remove the shared memory of killed lmcache_mp processes")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=_cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except LMCacheMPError as exc:
        print(f"lmcache-mp {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
