"""What vLLM engines leave behind is removed with the engines' own TMPDIR
(``engines.remove_engine_leftovers``), and only theirs.

The names are vLLM's, as its engines leave them on this machine's ``/tmp`` and
``/dev/shm`` when a two-rank CPU engine's workers are killed: the file store
``vllm_dist_<hex>`` (``get_file_store_init_method``), which names the TP group's shared
memory ``<store>-tp:0-[0-1]-cpushm_<rank>`` (the CPU worker's VLLM_DIST_IDENT,
``_CPUSHMDistributed.make_group_name``), and ZMQ IPC socket files ``<uuid4>``
(``get_open_zmq_ipc_path``). The live two-rank test
(``test_real_engine.py::test_tensor_parallel_two_ranks``) checks that real engines put
them in that TMPDIR.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.integrations.vllm.engines import remove_engine_leftovers, vllm_temp_files


def leave(tmp: Path, shm: Path, store: str) -> list[Path]:
    """A file store in ``tmp`` and its two ranks' segments in ``shm``."""
    (tmp / store).write_bytes(b"store")
    segments = [shm / f"{store}-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]
    for seg in segments:
        seg.write_bytes(b"\0" * 64)
    return segments


def test_the_engines_tmpdir_and_the_shared_memory_it_names_are_removed(tmp_path: Path) -> None:
    engines_tmp, shm = tmp_path / "engines", tmp_path / "shm"
    engines_tmp.mkdir()
    shm.mkdir()
    ours = leave(engines_tmp, shm, "vllm_dist_" + uuid.uuid4().hex)
    (engines_tmp / str(uuid.uuid4())).write_bytes(b"")  # an IPC socket's file
    # Another test process's engines: its store is in its own TMPDIR, not ours.
    others_tmp = tmp_path / "others"
    others_tmp.mkdir()
    theirs = leave(others_tmp, shm, "vllm_dist_" + uuid.uuid4().hex)
    unrelated = shm / "lmcache_l1_pool_1234"
    unrelated.write_bytes(b"")

    removed = remove_engine_leftovers(engines_tmp, shm)

    assert sorted(removed) == sorted(seg.name for seg in ours)
    assert not engines_tmp.exists()
    assert not any(seg.exists() for seg in ours)
    assert all(seg.exists() for seg in theirs) and unrelated.exists()


def test_nothing_left_is_nothing_removed(tmp_path: Path) -> None:
    engines_tmp = tmp_path / "engines"
    engines_tmp.mkdir()
    assert remove_engine_leftovers(engines_tmp, tmp_path) == []
    assert not engines_tmp.exists()
    assert remove_engine_leftovers(engines_tmp, tmp_path) == []  # twice: still fine


def test_vllm_temp_files_are_stores_and_ipc_sockets_only(tmp_path: Path) -> None:
    names = {"vllm_dist_" + uuid.uuid4().hex, str(uuid.uuid4())}
    for name in names | {"lmcache_mp-server-fork.sock", "pytest-of-root", "cfa1b2c3"}:
        (tmp_path / name).write_bytes(b"")
    assert vllm_temp_files(tmp_path) == names
