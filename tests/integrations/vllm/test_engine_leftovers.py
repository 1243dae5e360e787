"""What vLLM engines leave behind is removed with the engines' own TMPDIR
(``engines.remove_engine_leftovers``), and only theirs.

The leftovers are made by vLLM's own code in the vLLM venv, as a two-rank CPU engine's
rank makes them: its file store (``get_file_store_init_method``, in TMPDIR), the CPU
communicator's shared memory named after that store (``_CPUSHMDistributed``'s group
name, ``init_shm_manager``), left in ``/dev/shm`` because the process ends without its
destructors, as a killed rank does; and a ZMQ IPC path (``get_open_zmq_ipc_path``). The
live two-rank engine test (``test_real_engine.py::test_tensor_parallel_two_ranks``)
checks that real engines run with that TMPDIR.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SERVER_VERSION
from tests.integrations.vllm.engines import (
    remove_engine_leftovers,
    vllm_python,
    vllm_temp_files,
)

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(SERVER_VERSION != "0.5.3", reason=(
        "vLLM's own leftovers do not depend on the LMCache release: run with 0.5.3's jobs")),
]

SHM_DIR = Path("/dev/shm")

# Run by the vLLM venv's python with TMPDIR set: one rank of a one-rank CPU group.
LEAVE_AS_A_KILLED_RANK = """
import json, os, types
from vllm.utils.network_utils import get_file_store_init_method, get_open_zmq_ipc_path
from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
import torch
try:
    import vllm._C  # noqa: F401  (registers torch.ops._C.init_shm_manager)
except ImportError as exc:
    print(json.dumps({"skip": f"this vLLM tree has no CPU ops: {exc}"}))
    os._exit(0)
store = get_file_store_init_method().removeprefix("file://")
open(store, "w").close()  # what torch's FileStore creates
os.environ["VLLM_DIST_IDENT"] = os.path.basename(store)  # as vLLM's CPU worker sets it
group = _CPUSHMDistributed.make_group_name(types.SimpleNamespace(unique_name="tp:0", ranks=[0]))
torch.ops._C.init_shm_manager(group, 1, 0, 1)
print(json.dumps({"store": store, "group": group,
                  "ipc": get_open_zmq_ipc_path().removeprefix("ipc://")}), flush=True)
os._exit(0)  # no destructor runs: the segment stays, as a killed rank leaves it
"""


def leave_as_a_killed_rank(tmpdir: Path) -> dict[str, str]:
    out = subprocess.run([str(vllm_python()), "-c", LEAVE_AS_A_KILLED_RANK],
                         env={**os.environ, "TMPDIR": str(tmpdir)}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    made: dict[str, str] = json.loads(out.strip().splitlines()[-1])
    if "skip" in made:
        pytest.skip(made["skip"])
    return made


def segments_of(group: str) -> set[str]:
    # Not glob(): the group name's "[0]" would read as a character class.
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{group}_")}


def test_the_shared_memory_an_engines_tmpdir_names_is_removed_with_it(tmp_path: Path) -> None:
    ours_tmp, others_tmp = tmp_path / "ours", tmp_path / "others"
    ours_tmp.mkdir()
    others_tmp.mkdir()
    ours = leave_as_a_killed_rank(ours_tmp)
    theirs = leave_as_a_killed_rank(others_tmp)  # another test process's engines
    try:
        assert ours["store"].startswith(f"{ours_tmp}/")
        left = segments_of(ours["group"])
        assert left  # vLLM left its segment, as a killed rank does
        Path(ours["ipc"]).touch()  # the socket file a ZMQ IPC bind creates there
        assert vllm_temp_files(ours_tmp) == {Path(ours["store"]).name,
                                            Path(ours["ipc"]).name}

        assert sorted(remove_engine_leftovers(ours_tmp)) == sorted(left)
        assert not ours_tmp.exists() and not segments_of(ours["group"])
        assert segments_of(theirs["group"])  # not this TMPDIR's: left alone
    finally:
        remove_engine_leftovers(ours_tmp)
        remove_engine_leftovers(others_tmp)
    assert not segments_of(theirs["group"])


def test_nothing_left_is_nothing_removed(tmp_path: Path) -> None:
    engines_tmp = tmp_path / "engines"
    engines_tmp.mkdir()
    (engines_tmp / "config.json").write_text("{}")
    assert vllm_temp_files(engines_tmp) == set()
    assert remove_engine_leftovers(engines_tmp) == []
    assert not engines_tmp.exists()
    assert remove_engine_leftovers(engines_tmp) == []  # twice: still fine
