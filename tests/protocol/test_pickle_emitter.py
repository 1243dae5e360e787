"""The hand-written wrapper pickles are byte-identical to LMCache's and load in LMCache.

Fixtures come from tools/gen_pickle_fixtures.py (real 0.5.3 wrapper objects pickled in the
oracle venv). These tests never import lmcache and never unpickle in-process: pickles are
only disassembled here (pickletools), and loaded by tools/oracle_unpickle_check.py in the
oracle venv.
"""

from __future__ import annotations

import io
import json
import os
import pickletools
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.errors import InvalidArgument
from lmcache_mp.protocol.pickles.emitter import (
    TEMPLATE_NAMES,
    TORCH_DTYPES,
    emit,
    emit_cpu_shm_wrapper,
    emit_cuda_ipc_wrapper,
    emit_raw_cuda_wrapper,
    load_template,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "fixtures" / "v0.5.3" / "pickles.json").read_text())
CASES: list[dict[str, Any]] = FIXTURE["cases"]

UUID = "1f2e3d4c-5b6a-7988-a7b6-c5d4e3f2a1b0"
HANDLE = bytes(range(64))
CLASSES = {
    "v0_5_3_cpu_shm": ("lmcache.v1.platform.cpu.shm", "CpuShmTensorWrapper"),
    "v0_5_3_raw_cuda": ("lmcache.v1.platform.cuda.ipc_wrapper", "RawCudaIPCWrapper"),
    "v0_5_3_cuda_ipc": ("lmcache.v1.platform.cuda.ipc_wrapper", "CudaIPCWrapper"),
    "v0_5_5_raw_cuda": ("lmcache.v1.platform.cuda.ipc_wrapper", "RawCudaIPCWrapper"),
}


def untag(value: Any) -> Any:
    """Fixture JSON -> the value emit() takes."""
    if isinstance(value, dict):
        return bytes.fromhex(value["$bytes"])
    if isinstance(value, list):
        return tuple(untag(v) for v in value)
    return value


def tag(value: Any) -> Any:
    """The inverse of untag, for feeding the oracle checker."""
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, (tuple, list)):
        return [tag(v) for v in value]
    return value


def fields_of(case: dict[str, Any]) -> dict[str, Any]:
    return {k: untag(v) for k, v in case["fields"].items()}


def case_id(case: dict[str, Any]) -> str:
    return f"{case['template']}-{CASES.index(case)}"


# --- (a) byte-identical to pickle.dumps of the real objects ----------------------------


def test_fixtures_cover_enough() -> None:
    assert FIXTURE["meta"]["lmcache"] == "0.5.3"
    assert FIXTURE["meta"]["pickle_protocol"] == 4
    assert len(CASES) >= 60
    # v0_5_5_raw_cuda's fixtures come from the 0.5.5 oracle (fixtures/v0.5.5/wrappers.json,
    # tests/protocol/test_codec_fixtures.py).
    assert {c["template"] for c in CASES} == set(TEMPLATE_NAMES) - {"v0_5_5_raw_cuda"}
    assert {c["fields"]["dtype"] for c in CASES} == TORCH_DTYPES
    assert {len(c["fields"]["shape"]) for c in CASES} >= set(range(0, 9))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emit_is_byte_identical_to_lmcache(case: dict[str, Any]) -> None:
    assert emit(case["template"], fields_of(case)).hex() == case["pickle"]


def test_typed_helpers_match_fixtures() -> None:
    for case in CASES:
        f = fields_of(case)
        if case["template"] == "v0_5_3_cpu_shm":
            out = emit_cpu_shm_wrapper(
                shm_name=f["shm_name"], nbytes=f["nbytes"], dtype=f["dtype"],
                shape=f["shape"], stride=f["stride"], storage_offset=f["storage_offset"],
            )
        elif case["template"] == "v0_5_3_raw_cuda":
            out = emit_raw_cuda_wrapper(
                ipc_handle=f["_ipc_handle_reserved"], nbytes=f["_nbytes"], dtype=f["dtype"],
                shape=f["shape"], stride=f["stride"], storage_offset=f["storage_offset"],
                device_uuid=f["device_uuid"],
            )
        else:
            out = emit_cuda_ipc_wrapper(
                handle=f["handle"], dtype=f["dtype"], shape=f["shape"], stride=f["stride"],
                storage_offset=f["storage_offset"], device_uuid=f["device_uuid"],
            )
        assert out.hex() == case["pickle"], case["fields"]


def test_lists_and_torch_prefix_and_subclasses_give_the_same_bytes() -> None:
    class Name(str):
        def encode(self, *a: Any, **k: Any) -> bytes:  # must not be used
            return b"INJECTED"

    class Dim(int):
        def __index__(self) -> int:  # must not be used
            return 999

    base = emit_cpu_shm_wrapper(
        shm_name="/x", nbytes=8, dtype="float16", shape=(2, 2), stride=(2, 1)
    )
    assert emit_cpu_shm_wrapper(
        shm_name=Name("/x"), nbytes=Dim(8), dtype="torch.float16", shape=[Dim(2), 2],
        stride=[2, 1],
    ) == base
    assert emit("v0_5_3_cpu_shm", {"shm_name": "/x", "nbytes": 8, "dtype": "float16",
                                   "shape": (2, 2), "stride": (2, 1), "storage_offset": 0,
                                   "handle": None, "device_uuid": "cpu"}) == base


# --- (b) the reference disassembly of the protocol doc, section 4.3 --------------------


def _s(text: str) -> str:  # SHORT_BINUNICODE <len> <utf-8> MEMOIZE, as in the doc listing
    return "8c" + bytes([len(text)]).hex() + text.encode().hex() + "94"


def test_reference_disassembly_from_the_protocol_doc() -> None:
    body = (
        _s("lmcache.v1.platform.cpu.shm") + _s("CpuShmTensorWrapper") + "93" + "94"
        + "29" + "81" + "94"
        + "7d" + "94" + "28"
        + _s("shm_name") + _s("/lmcache_kv_1234_0")
        + _s("nbytes") + "4a" + "00000200"
        + _s("handle") + "4e"
        + _s("dtype") + _s("torch") + _s("float16") + "93" + "94"
        + _s("shape") + "28" + "4b02" + "4b04" + "4b08" + "4b10" + "4b40" + "74" + "94"
        + _s("stride") + "28" + "4a00000100" + "4d0040" + "4d0008" + "4b40" + "4b01" + "74"
        + "94"
        + _s("storage_offset") + "4b00"
        + _s("device_uuid") + _s("cpu")
        + "75" + "62" + "2e"
    )
    expected = "8004" + "95" + "ea00000000000000" + body
    out = emit_cpu_shm_wrapper(
        shm_name="/lmcache_kv_1234_0", nbytes=131072, dtype="float16",
        shape=(2, 4, 8, 16, 64), stride=(65536, 16384, 2048, 64, 1), storage_offset=0,
    )
    assert len(out) == 245
    assert out.hex() == expected
    assert struct.unpack_from("<Q", out, 3)[0] == 234 == len(out) - 11


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "4b00"), (255, "4bff"), (256, "4d0001"), (65535, "4dffff"), (65536, "4a00000100"),
        (2**31 - 1, "4affffff7f"), (-1, "4affffffff"), (-(2**31), "4a00000080"),
        (2**31, "8a050000008000"), (2**33, "8a050000000002"), (-(2**31) - 1, "8a05ffffff7fff"),
        (2**63 - 1, "8a08ffffffffffffff7f"), (-(2**63), "8a080000000000000080"),
        (-(2**39), "8a050000000080"),
    ],
)
def test_int_encodings(value: int, encoded: str) -> None:
    out = emit_cpu_shm_wrapper(shm_name="/i", nbytes=0, dtype="int8", shape=(1,),
                               stride=(value,))
    stride_key = _s("stride")
    assert (stride_key + encoded + "85" + "94") in out.hex()


# --- (c) validation --------------------------------------------------------------------

GOOD_CPU: dict[str, Any] = {
    "shm_name": "/lmcache_kv_1_0", "nbytes": 64, "dtype": "float16", "shape": (2, 16),
    "stride": (16, 1), "storage_offset": 0,
}
GOOD_RAW: dict[str, Any] = {
    "ipc_handle": HANDLE, "nbytes": 64, "dtype": "bfloat16", "shape": (2, 16),
    "stride": (16, 1), "storage_offset": 0, "device_uuid": UUID,
}
GOOD_IPC_HANDLE = (0, b"\x03c" + HANDLE, 4096, 0, b"/torch_1_2_3", 0, bytes(64), False)


def after(data: bytes, name: str) -> Any:
    """The argument of the opcode that follows the field name ``name`` in a pickle's
    disassembly (read with pickletools, never unpickled): the field's value."""
    args = [arg for op, arg, _ in pickletools.genops(data) if op.name != "MEMOIZE"]
    return args[args.index(name) + 1]


def test_good_values_pass_and_land_in_their_fields() -> None:
    cpu = emit_cpu_shm_wrapper(**GOOD_CPU)
    assert (after(cpu, "shm_name"), after(cpu, "nbytes")) == ("/lmcache_kv_1_0", 64)
    assert after(cpu, "torch") == "float16" and after(cpu, "storage_offset") == 0
    raw = emit_raw_cuda_wrapper(**GOOD_RAW)
    assert after(raw, "_ipc_handle_reserved") == HANDLE and after(raw, "device_uuid") == UUID
    assert after(raw, "torch") == "bfloat16" and after(raw, "_nbytes") == 64
    ipc = emit_cuda_ipc_wrapper(handle=GOOD_IPC_HANDLE, dtype="float16", shape=(2,),
                                stride=(1,), device_uuid=UUID)
    assert b"/torch_1_2_3" in ipc and b"\x03c" + HANDLE in ipc
    assert after(ipc, "device_uuid") == UUID
    long_name = "/" + "a" * 250  # over 255 bytes with its opcode: BINUNICODE, not SHORT_
    assert after(emit_cpu_shm_wrapper(**{**GOOD_CPU, "shm_name": long_name}),
                 "shm_name") == long_name


BAD_CPU = [
    ("dtype", "float128"), ("dtype", "float16\n."), ("dtype", "float16."), ("dtype", "Float16"),
    ("dtype", "half"), ("dtype", "torch"), ("dtype", ""), ("dtype", 5), ("dtype", None),
    ("dtype", "torch.float16 "), ("dtype", "__class__"),
    ("shape", (True, 16)), ("shape", (-1, 16)), ("shape", (2.0, 16)), ("shape", "21"),
    ("shape", None), ("shape", (2**63, 1)), ("shape", (1,) * 9),
    ("stride", (16,)), ("stride", (16, 1, 1)), ("stride", (16, False)), ("stride", (2**63, 1)),
    ("stride", (-(2**63) - 1, 1)), ("stride", {16: 1}),
    ("shm_name", "/a/b"), ("shm_name", "/a\x00b"), ("shm_name", "/" + "a" * 251),
    ("shm_name", '/a"b'), ("shm_name", "/a'b"), ("shm_name", "lmcache_kv"), ("shm_name", "/"),
    ("shm_name", "/."), ("shm_name", "/.."), ("shm_name", "/a\n"), ("shm_name", "/a b"),
    ("shm_name", "//a"), ("shm_name", "/é"), ("shm_name", b"/a"), ("shm_name", ""),
    ("nbytes", -1), ("nbytes", 2**63), ("nbytes", True), ("nbytes", 1.5), ("nbytes", None),
    ("nbytes", "64"),
    ("storage_offset", -1), ("storage_offset", 2**63), ("storage_offset", False),
]


@pytest.mark.parametrize(("field", "value"), BAD_CPU, ids=lambda x: repr(x)[:40])
def test_cpu_validation_rejects(field: str, value: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        emit_cpu_shm_wrapper(**{**GOOD_CPU, field: value})
    # The message names the field and says what to do.
    assert f".{field}" in str(info.value)
    assert "; " in str(info.value)


BAD_RAW = [
    ("device_uuid", UUID.upper()), ("device_uuid", "GPU-" + UUID), ("device_uuid", UUID + "\n"),
    ("device_uuid", UUID.replace("-", "")), ("device_uuid", "1f2e3d4c5b6a-7988-a7b6-c5d4-e3f2a1b0"),
    ("device_uuid", "{" + UUID + "}"), ("device_uuid", UUID[:-1]), ("device_uuid", UUID + "0"),
    ("device_uuid", "cpu"), ("device_uuid", None), ("device_uuid", "g" + UUID[1:]),
    ("ipc_handle", bytes(63)), ("ipc_handle", bytes(65)), ("ipc_handle", b""),
    ("ipc_handle", HANDLE.hex()), ("ipc_handle", None), ("ipc_handle", list(HANDLE)),
    ("nbytes", -5), ("dtype", "float16\n."), ("shape", (1, -2)), ("stride", (1,)),
]


@pytest.mark.parametrize(("field", "value"), BAD_RAW, ids=lambda x: repr(x)[:40])
def test_raw_cuda_validation_rejects(field: str, value: Any) -> None:
    with pytest.raises(InvalidArgument):
        emit_raw_cuda_wrapper(**{**GOOD_RAW, field: value})


@pytest.mark.parametrize(
    ("index", "value"),
    [(0, -1), (0, True), (1, bytes(63)), (1, "x" * 64), (2, -1), (3, 2**63), (4, b""),
     (4, bytes(256)), (5, None), (6, bytes(63)), (6, bytes(65)), (7, 0), (7, None)],
)
def test_cuda_ipc_handle_validation_rejects(index: int, value: Any) -> None:
    handle = list(GOOD_IPC_HANDLE)
    handle[index] = value
    with pytest.raises(InvalidArgument):
        emit_cuda_ipc_wrapper(handle=tuple(handle), dtype="float16", shape=(2,), stride=(1,),
                              device_uuid=UUID)
    with pytest.raises(InvalidArgument):
        emit_cuda_ipc_wrapper(handle=GOOD_IPC_HANDLE[:7], dtype="float16", shape=(2,),
                              stride=(1,), device_uuid=UUID)


def test_generic_emit_rejects_bad_templates_and_fields() -> None:
    good = {**GOOD_CPU}
    for name in ["../v0_5_3_cpu_shm", "v0_5_3_cpu_shm.json", "nope", ""]:
        with pytest.raises(InvalidArgument):
            emit(name, good)
    with pytest.raises(InvalidArgument, match="unknown field"):
        emit("v0_5_3_cpu_shm", {**good, "extra": 1})
    with pytest.raises(InvalidArgument, match="missing"):
        emit("v0_5_3_cpu_shm", {k: v for k, v in good.items() if k != "nbytes"})
    with pytest.raises(InvalidArgument):
        emit("v0_5_3_cpu_shm", {**good, "device_uuid": "cuda"})
    with pytest.raises(InvalidArgument):
        emit("v0_5_3_cpu_shm", {**good, "handle": 0})
    with pytest.raises(InvalidArgument):
        emit("v0_5_3_cpu_shm", [("shm_name", "/x")])  # type: ignore[arg-type]


def test_templates_ship_and_match_the_lmcache_init_order() -> None:
    shipped = {p.stem for p in (REPO / "pickle_templates").glob("*.json")}
    assert shipped == set(TEMPLATE_NAMES)
    order = {
        "v0_5_3_cpu_shm": ["shm_name", "nbytes", "handle", "dtype", "shape", "stride",
                           "storage_offset", "device_uuid"],
        "v0_5_3_raw_cuda": ["_ipc_handle_reserved", "_nbytes", "handle", "dtype", "shape",
                            "stride", "storage_offset", "device_uuid"],
        "v0_5_3_cuda_ipc": ["handle", "dtype", "shape", "stride", "storage_offset",
                            "device_uuid"],
        "v0_5_5_raw_cuda": ["_ipc_handle_reserved", "_alloc_offset", "_nbytes", "handle",
                            "dtype", "shape", "stride", "storage_offset", "_opens",
                            "device_uuid"],
    }
    for name in TEMPLATE_NAMES:
        t = load_template(name)
        assert (t.module, t.qualname) == CLASSES[name]
        assert [f.name for f in t.fields] == order[name]
        assert all(f.description for f in t.fields)
        assert name[1:6].replace("_", ".") in t.lmcache_versions


def test_emitter_imports_neither_lmcache_nor_torch() -> None:
    code = (
        "import sys, lmcache_mp.protocol.pickles.emitter as e\n"
        "e.emit_cpu_shm_wrapper(shm_name='/x', nbytes=0, dtype='float16', shape=(), stride=())\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lmcache', 'torch', 'cuda')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# --- random combinations (used by (d) and (e)) -----------------------------------------


def random_cases(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    ints = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1]
    dtypes = sorted(TORCH_DTYPES)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        ndim = rng.randint(0, 8)
        shape = tuple(rng.choice(ints[:6]) for _ in range(ndim))
        stride = tuple(rng.choice(ints) * rng.choice([1, -1]) for _ in range(ndim))
        common = {"dtype": rng.choice(dtypes), "shape": shape, "stride": stride,
                  "storage_offset": rng.choice(ints)}
        uuid = "-".join(
            "".join(rng.choice("0123456789abcdef") for _ in range(k)) for k in (8, 4, 4, 4, 12)
        )
        kind = TEMPLATE_NAMES[i % 3]
        if kind == "v0_5_3_cpu_shm":
            name = "/" + "".join(rng.choice(chars) for _ in range(rng.choice([1, 20, 250])))
            fields = {"shm_name": name, "nbytes": rng.choice(ints), **common}
        elif kind == "v0_5_3_raw_cuda":
            fields = {"_ipc_handle_reserved": rng.randbytes(64), "_nbytes": rng.choice(ints),
                      **common, "device_uuid": uuid}
        else:
            handle = (rng.randrange(8), rng.randbytes(rng.choice([64, 66, 300])),
                      rng.choice(ints), rng.choice(ints), rng.randbytes(rng.randint(1, 255)),
                      rng.choice(ints), rng.randbytes(64), rng.random() < 0.5)
            fields = {"handle": handle, **common, "device_uuid": uuid}
        out.append((kind, fields))
    return out


# --- (d) the real LMCache loads our bytes into the expected objects --------------------


ORACLE_ENV = {
    **os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1",
}


def _oracle_python() -> Path:
    venv = subprocess.run(
        ["bash", str(REPO / "scripts" / "lmcache-server.sh"), "venv"],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout.strip()
    return Path(venv) / "bin" / "python"


def test_oracle_unpickles_our_bytes_to_the_expected_objects() -> None:
    python = _oracle_python()
    if not python.exists():
        pytest.skip("oracle venv not installed: run scripts/lmcache-server.sh install")
    request = [
        {"template": kind, "pickle": emit(kind, fields).hex(),
         "fields": {k: tag(v) for k, v in fields.items()}}
        for kind, fields in random_cases(21, seed=20260503)
    ]
    proc = subprocess.run(
        [str(python), str(REPO / "tools" / "oracle_unpickle_check.py")],
        input=json.dumps(request), capture_output=True, text=True, timeout=240, cwd=REPO,
        env=ORACLE_ENV,
    )
    assert proc.stdout, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["count"] == len(request)
    assert report["ok"], [r for r in report["results"] if not r["ok"]]
    assert proc.returncode == 0


def test_oracle_checker_notices_a_wrong_field() -> None:
    python = _oracle_python()
    if not python.exists():
        pytest.skip("oracle venv not installed: run scripts/lmcache-server.sh install")
    fields = {**GOOD_CPU}
    request = [{"template": "v0_5_3_cpu_shm", "pickle": emit_cpu_shm_wrapper(**fields).hex(),
                "fields": {**{k: tag(v) for k, v in fields.items()}, "nbytes": 65}}]
    proc = subprocess.run(
        [str(python), str(REPO / "tools" / "oracle_unpickle_check.py")],
        input=json.dumps(request), capture_output=True, text=True, timeout=240, cwd=REPO,
        env=ORACLE_ENV,
    )
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["failed"] == 1


# --- (e) static disassembly: only data opcodes, exactly the two expected globals --------

ALLOWED_OPS = {
    "PROTO", "FRAME", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE", "STACK_GLOBAL",
    "EMPTY_TUPLE", "NEWOBJ", "EMPTY_DICT", "MARK", "SETITEM", "SETITEMS", "BUILD", "STOP",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "LONG1", "TUPLE1",
    "TUPLE2", "TUPLE3", "TUPLE", "SHORT_BINBYTES", "BINBYTES",
}


MEMOIZED_OPS = {
    "SHORT_BINUNICODE", "BINUNICODE", "SHORT_BINBYTES", "BINBYTES", "STACK_GLOBAL",
    "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE", "NEWOBJ", "EMPTY_DICT",
}


def _all_outputs() -> list[tuple[str, dict[str, Any], bytes]]:
    out = [(c["template"], fields_of(c), emit(c["template"], fields_of(c))) for c in CASES]
    out += [(k, f, emit(k, f)) for k, f in random_cases(60, seed=7)]
    return out


def test_disassembly_has_only_data_opcodes_and_the_two_expected_globals() -> None:
    for kind, fields, data in _all_outputs():
        pickletools.dis(data, out=io.StringIO())  # well-formed, stack balanced, ends in STOP
        ops = list(pickletools.genops(data))
        names = [op.name for op, _, _ in ops]
        assert set(names) <= ALLOWED_OPS, set(names) - ALLOWED_OPS
        assert names[:2] == ["PROTO", "FRAME"] and names[-2:] == ["BUILD", "STOP"]
        assert ops[0][1] == 4 and ops[1][1] == len(data) - 11  # one frame: all the rest
        globals_ = [
            (ops[i - 4][1], ops[i - 2][1]) for i, n in enumerate(names) if n == "STACK_GLOBAL"
        ]
        dtype = fields["dtype"].removeprefix("torch.")
        assert globals_ == [CLASSES[kind], ("torch", dtype)]
        # MEMOIZE follows exactly what pickle memoizes (every str, bytes, non-empty tuple,
        # global, the new object and the dict) and nothing else; no memo reads at all.
        after = [names[i - 1] for i, n in enumerate(names) if n == "MEMOIZE"]
        memoized = [n for n in names if n in MEMOIZED_OPS]
        assert after == memoized


@pytest.mark.skipif("mutants" in REPO.parts, reason=(
    "under mutmut: a copy of its mutated lmcache_mp cannot import outside the mutants/ "
    "tree (its trampoline looks for mutmut's configuration in the working directory)"))
def test_templates_load_from_a_source_checkout(tmp_path: Path) -> None:
    """lmcache_mp used from a checkout on sys.path, not installed (the GPU check does
    that on the device): lmcache_mp.pickle_templates does not exist, and the templates
    come from the checkout's top-level pickle_templates/ folder."""
    import shutil

    shutil.copytree(REPO / "lmcache_mp", tmp_path / "lmcache_mp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "pickle_templates", tmp_path / "pickle_templates",
                    ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    case = next(c for c in FIXTURE["cases"] if c["template"] == "v0_5_3_cuda_ipc")
    code = "\n".join([
        "import sys, json",
        # Drop the editable install's finder: only the copied checkout may answer.
        "sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]",
        f"sys.path.insert(0, {str(tmp_path)!r})",
        "import lmcache_mp, lmcache_mp.protocol.pickles.emitter as e",
        f"assert lmcache_mp.__file__.startswith({str(tmp_path)!r}), lmcache_mp.__file__",
        "import importlib.util",
        "assert importlib.util.find_spec('lmcache_mp.pickle_templates') is None",
        f"case = json.loads({json.dumps(json.dumps(case))})",
        "fields = {k: (bytes.fromhex(v['$bytes']) if isinstance(v, dict) else v)",
        "          for k, v in case['fields'].items()}",
        "fields['handle'] = [bytes.fromhex(h['$bytes']) if isinstance(h, dict) else h",
        "                    for h in fields['handle']]",
        "print(e.emit(case['template'], fields).hex())",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == case["pickle"]
