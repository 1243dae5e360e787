"""The sweep of dead processes' SHM segments (local): SIGKILLed, zombie and recycled
pids are swept, live processes', other namespaces' and other formats' never; the
``clean`` command and ``doctor --clean``. Issue 12, finding 3 (see also
tests/live/test_leaks.py).

Every test here runs in a sweep scope of its own (``LMCACHE_MP_SHM_SCOPE``, set for
this process and inherited by its children): ``make test`` runs other pytest jobs
beside this one, and any of their cache allocations sweeps the dead processes' segments
of *its* scope. Without the scope, the segments these tests leave on purpose were swept
by another job before the test could assert on them (issue 37).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lmcache_mp import CpuKVCache
from lmcache_mp.cli import main as cli_main
from lmcache_mp.ipc import shm
from lmcache_mp.ipc.shm import NAME_PREFIX, SCOPE_ENV, SHM_DIR, sweep_dead_segments

from ..support.polling import wait_until

SCOPE = f"sweeptest{os.getpid()}"


@pytest.fixture(autouse=True)
def _own_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCOPE_ENV, SCOPE)

_CHILD = """
import sys, time
from lmcache_mp import CpuKVCache
kv = CpuKVCache.allocate(num_layers=2, num_blocks=4, block_size=16, num_heads=1, head_dim=8)
print(" ".join(n[1:] for n in kv.segment_names), flush=True)
time.sleep(60)
"""


def _child_with_a_cache() -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    names = child.stdout.readline().split()
    assert len(names) == 2 and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    return child, names


def _ours(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_a_sigkilled_process_segments_are_swept_and_a_live_ones_kept() -> None:
    dead, dead_names = _child_with_a_cache()
    live, live_names = _child_with_a_cache()
    try:
        dead.kill()
        dead.wait()
        assert all(_ours(n) for n in dead_names)  # SIGKILL unlinks nothing
        with CpuKVCache.allocate(num_layers=1, num_blocks=4, block_size=16, num_heads=1,
                                 head_dim=8) as mine:
            assert not any(_ours(n) for n in dead_names)  # swept by the allocation
            assert all(_ours(n) for n in live_names)  # the live process's are kept
            assert all(_ours(n[1:]) for n in mine.segment_names)
    finally:
        live.kill()
        live.wait()
    assert sweep_dead_segments().removed == tuple(sorted(live_names))


def test_a_zombie_and_a_recycled_pid_are_swept_other_namespaces_and_formats_never() -> None:
    ns = shm._pid_namespace()
    old = time.time() - 600
    made: list[str] = []

    def segment(pid: int, ns_id: int, mtime: float | None = None, tag: str = "kv") -> str:
        name = f"{NAME_PREFIX}{SCOPE}.{pid}_{ns_id}_0_{tag}_{os.urandom(4).hex()}"
        path = os.path.join(SHM_DIR, name)
        with open(path, "wb") as f:
            f.write(b"x")
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        made.append(name)
        return name

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_until(lambda: open(f"/proc/{zombie.pid}/stat").read().split(") ")[1][0]
                          == "Z")  # exited, not yet reaped
        of_zombie = segment(zombie.pid, ns)
        recycled = segment(sleeper.pid, ns, mtime=old)  # made before the sleeper started
        of_parent = segment(os.getppid(), ns)  # a live process that started earlier
        other_ns = segment(999_999_999, ns + 1)  # pids of another namespace: unknown
        legacy = f"{NAME_PREFIX}{999_999_999}_0_kv_{os.urandom(4).hex()}"  # old format
        open(os.path.join(SHM_DIR, legacy), "wb").close()
        made.append(legacy)
        listed = sweep_dead_segments(dry_run=True)
        assert {of_zombie, recycled} <= set(listed.removed) and all(map(_ours, made))
        swept = sweep_dead_segments()
        assert {of_zombie, recycled} <= set(swept.removed)
        assert not _ours(of_zombie) and not _ours(recycled)
        assert _ours(of_parent) and _ours(other_ns) and _ours(legacy)
    finally:
        for name in made:
            if _ours(name):
                os.unlink(os.path.join(SHM_DIR, name))
        zombie.wait()
        sleeper.kill()
        sleeper.wait()


def _dead_children(n: int) -> list[str]:
    # All started before any dies: a child's own allocation sweeps the others'.
    children = [_child_with_a_cache() for _ in range(n)]
    names = []
    for child, child_names in children:
        child.kill()
        child.wait()
        names += child_names
    return names


def test_the_clean_command_and_doctor_clean(capsys: pytest.CaptureFixture[str]) -> None:
    names = _dead_children(2)
    assert cli_main(["clean", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(f"would remove {SHM_DIR}/{n}" in out for n in names)
    assert all(_ours(n) for n in names)
    assert cli_main(["clean"]) == 0
    assert not any(_ours(n) for n in names)
    out = capsys.readouterr().out
    assert all(f"removed {SHM_DIR}/{n}" in out for n in names)
    names = _dead_children(1)
    assert cli_main(["doctor", "--clean"]) == 0
    assert not any(_ours(n) for n in names)
    out = capsys.readouterr().out
    assert all(f"removed {SHM_DIR}/{n}" in out for n in names)


def test_a_sweep_never_touches_another_scopes_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dead processes' segments of another scope (and of none) are kept; each scope's
    own sweep removes its own."""
    dead_here = _dead_children(1)
    monkeypatch.setenv(SCOPE_ENV, "othertenant")
    dead_other = _dead_children(1)
    assert all(n.startswith(f"{NAME_PREFIX}othertenant.") for n in dead_other)
    monkeypatch.delenv(SCOPE_ENV)
    dead_unscoped = _dead_children(1)
    try:
        assert not any(n.startswith(f"{NAME_PREFIX}{SCOPE}") for n in dead_unscoped)
        swept = sweep_dead_segments()  # no scope: only unscoped names (another job's
        # allocation, of no scope, may have swept these first: asserted gone, not removed here)
        assert not any(map(_ours, dead_unscoped))
        assert not set(swept.removed) & set(dead_here + dead_other)
        assert all(map(_ours, dead_here + dead_other))
        monkeypatch.setenv(SCOPE_ENV, SCOPE)
        with CpuKVCache.allocate(num_layers=1, num_blocks=4, block_size=16, num_heads=1,
                                 head_dim=8):
            assert not any(map(_ours, dead_here))  # swept by this scope's allocation
            assert all(map(_ours, dead_other))
    finally:
        monkeypatch.setenv(SCOPE_ENV, "othertenant")
        sweep_dead_segments()
        monkeypatch.setenv(SCOPE_ENV, SCOPE)
    assert not any(map(_ours, dead_other))


def test_a_malformed_scope_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCOPE_ENV, "Bad-Scope")
    with pytest.raises(shm.InvalidArgument, match="LMCACHE_MP_SHM_SCOPE"):
        sweep_dead_segments()
