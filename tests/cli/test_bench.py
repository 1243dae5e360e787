"""lmcache-mp bench's reporting (no server): medians, ratios against their targets, the
table, the chart, and the plan's interleaving. The live run is `make bench-smoke` (CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_mp.cli import bench, bench_report
from lmcache_mp.cli import main as cli_main

SAMPLES = {
    "noop_us": {"ours": [100.0, 110.0, 90.0], "bare": [100.0, 100.0, 100.0],
                "lmcache": [150.0, 160.0, 140.0]},
    "request_cpu_us.store": {"ours": [100.0, 100.0, 100.0], "ours_numpy": [90.0] * 3,
                             "lmcache": [250.0, 250.0, 250.0]},
    "gbps.engine.NHD.store": {"ours": [7.0, 8.0, 9.0], "memcpy": [10.0, 10.0, 10.0]},
    "gbps.engine.HND.store": {"ours": [5.0, 5.0, 5.0], "memcpy": [10.0, 10.0, 10.0]},
    "import_ms": {"ours": [60.0, 70.0, 80.0]},
}


def test_summary_ratios_and_targets() -> None:
    s = bench_report.summarize(SAMPLES)
    assert s["medians"]["noop_us"]["ours"] == 100.0
    r = {x["name"]: x for x in s["ratios"]}
    assert r["NOOP latency ours / bare DEALER"]["ratio"] == pytest.approx(1.0)
    assert r["STORE client CPU ours / LMCache"]["ratio"] == pytest.approx(0.4)
    assert r["STORE client CPU ours / LMCache"]["met"] is True
    assert r["engine NHD STORE ours / memcpy"]["met"] is True  # 0.8 >= 0.8
    assert r["engine HND STORE ours / memcpy"]["met"] is False  # 0.5 < 0.6
    assert "RETRIEVE client CPU ours / LMCache" not in r  # not measured: no ratio
    text = bench_report.table({**s})
    assert "MISSED" in text and "import_ms" in text and "lmcache" in text


def test_chart_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the 'bench' extra (matplotlib) is not installed")
    result = {"samples": SAMPLES, "config": {"rounds": 3}, "server": "tcp://x",
              "machine": bench_report.machine(), **bench_report.summarize(SAMPLES)}
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert cli_main(["bench", "--chart", str(tmp_path / "r.json"), "--png",
                     str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


class Fake(bench.Contender):
    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0

    def noop_us(self, n: int) -> bench.Sample:
        self.calls += 1
        return float(self.calls)


def test_rounds_interleave_and_drop_the_warm_up() -> None:
    cfg = bench.Config(rounds=3, quick=True)
    order: list[str] = []
    a, b = Fake("a"), Fake("b")
    out = bench.run([a, b], cfg, clear=lambda: None,
                    progress=lambda d, t, w: order.append(w) if "noop" in w else None)
    assert out["noop_us"] == {"a": [2.0, 3.0, 4.0], "b": [2.0, 3.0, 4.0]}  # round 0 dropped
    firsts = [w.split(": ")[1] for w in order[::2]]
    assert firsts == ["a", "b", "a", "b"]  # who goes first alternates


def test_memcpy_floor_measures_engine_transfers_only() -> None:
    m = bench.Memcpy(bench.Config(rounds=1, quick=True))
    store, retrieve = m.transfer("engine", "NHD", False)
    assert store is not None and retrieve is not None and store > 0
    assert m.transfer("lmcache", "HND", False) == (None, None)


def test_bench_without_url_says_what_to_give() -> None:
    with pytest.raises(SystemExit, match="URL"):
        cli_main(["bench"])
