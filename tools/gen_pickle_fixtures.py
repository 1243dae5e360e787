#!/usr/bin/env python3
"""Record real ``pickle.dumps`` bytes of LMCache's KV-cache IPC wrappers (run in the oracle venv).

    scripts/lmcache-server.sh python -- tools/gen_pickle_fixtures.py [--out fixtures]

Builds real ``CpuShmTensorWrapper`` / ``RawCudaIPCWrapper`` / ``CudaIPCWrapper`` objects
of the installed LMCache (0.5.3) without a tensor or a GPU: ``object.__new__(cls)`` and
then the attributes in the order the class's ``__init__`` assigns them (that order is the
``__dict__`` order pickle writes). Every case is written to ``<out>/v<version>/pickles.json``
as ``{"template", "fields", "pickle": hex}``; tests/protocol/test_pickle_emitter.py checks that
``lmcache_mp.protocol.pickles.emitter`` reproduces each pickle byte for byte, without lmcache.

Field values are JSON with bytes tagged as ``{"$bytes": hex}``; tuples are lists and the
dtype is its canonical torch name (``"float16"``). Deterministic (fixed seed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pickle
import pickletools
import platform
import random
import uuid
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.platform.cpu.shm import CpuShmTensorWrapper
from lmcache.v1.platform.cuda.ipc_wrapper import CudaIPCWrapper, RawCudaIPCWrapper

# The dtype names lmcache_mp.protocol.pickles.emitter.TORCH_DTYPES supports (kept separate on
# purpose: this script is the oracle and must not import lmcache_mp).
DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2",
]

# Every int encoding boundary: BININT1 / BININT2 / BININT / LONG1 of 1..9 bytes.
NBYTES = [0, 1, 255, 256, 65535, 65536, 131072, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
          2**33, 2**40, 2**47, 2**48 - 1, 2**55, 2**63 - 1]
OFFSETS = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40, 2**63 - 1]
STRIDE_EDGES = [0, 1, -1, 127, 128, 255, 256, -128, -129, -256, 65535, 65536, -65536,
                -65537, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 2**32, 2**40, -(2**40),
                2**63 - 1, -(2**63), -(2**63) + 1, -(2**55), 2**55, 2**47 - 1, -(2**47)]
SHM_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
UUIDS = [
    "00000000-0000-0000-0000-000000000000",
    "ffffffff-ffff-ffff-ffff-ffffffffffff",
    "1f2e3d4c-5b6a-7988-a7b6-c5d4e3f2a1b0",
    "0b8a1c3e-77f4-4d2a-9a61-2f5c8e9d0a17",
]


def contiguous_stride(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return stride[::-1]


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fresh_bytes(data: bytes) -> bytes:
    # A new object per field, like the real wrappers' (never a shared one -> no BINGET).
    return bytes(bytearray(data))


def build(cls: type, attrs: list[tuple[str, Any]]) -> Any:
    obj = object.__new__(cls)
    for name, value in attrs:  # __init__ order == __dict__ order == pickle order
        setattr(obj, name, value)
    return obj


def cpu_case(shm_name: str, nbytes: int, dtype: str, shape: list[int], stride: list[int],
             storage_offset: int) -> tuple[Any, dict[str, Any]]:
    obj = build(CpuShmTensorWrapper, [
        ("shm_name", "".join(shm_name)),
        ("nbytes", nbytes),
        ("handle", None),
        ("dtype", getattr(torch, dtype)),
        ("shape", tuple(shape)),  # tuple(...) as in __init__: distinct objects
        ("stride", tuple(stride)),
        ("storage_offset", storage_offset),
        ("device_uuid", "cpu"),
    ])
    fields = {"shm_name": shm_name, "nbytes": nbytes, "handle": None, "dtype": dtype,
              "shape": shape, "stride": stride, "storage_offset": storage_offset,
              "device_uuid": "cpu"}
    return obj, fields


def raw_cuda_case(handle: bytes, nbytes: int, dtype: str, shape: list[int], stride: list[int],
                  storage_offset: int, device_uuid: str) -> tuple[Any, dict[str, Any]]:
    obj = build(RawCudaIPCWrapper, [
        ("_ipc_handle_reserved", fresh_bytes(handle)),
        ("_nbytes", nbytes),
        ("handle", None),
        ("dtype", getattr(torch, dtype)),
        ("shape", tuple(shape)),
        ("stride", tuple(stride)),
        ("storage_offset", storage_offset),
        ("device_uuid", str(uuid.UUID(device_uuid))),
    ])
    fields = {"_ipc_handle_reserved": {"$bytes": handle.hex()}, "_nbytes": nbytes,
              "handle": None, "dtype": dtype, "shape": shape, "stride": stride,
              "storage_offset": storage_offset, "device_uuid": device_uuid}
    return obj, fields


def cuda_ipc_case(handle: list[Any], dtype: str, shape: list[int], stride: list[int],
                  storage_offset: int, device_uuid: str) -> tuple[Any, dict[str, Any]]:
    real = tuple(fresh_bytes(h) if isinstance(h, bytes) else h for h in handle)
    obj = build(CudaIPCWrapper, [
        ("handle", real),
        ("dtype", getattr(torch, dtype)),
        ("shape", tuple(shape)),
        ("stride", tuple(stride)),
        ("storage_offset", storage_offset),
        ("device_uuid", str(uuid.UUID(device_uuid))),
    ])
    tagged = [{"$bytes": h.hex()} if isinstance(h, bytes) else h for h in handle]
    fields = {"handle": tagged, "dtype": dtype, "shape": shape, "stride": stride,
              "storage_offset": storage_offset, "device_uuid": device_uuid}
    return obj, fields


def rand_shm_name(rng: random.Random, length: int) -> str:
    return "/" + "".join(rng.choice(SHM_CHARS) for _ in range(length))


def rand_shape(rng: random.Random, ndim: int) -> list[int]:
    return [rng.choice([0, 1, 2, 3, 16, 64, 128, 255, 256, 1000, 65536, 70000])
            for _ in range(ndim)]


def rand_stride(rng: random.Random, shape: list[int]) -> list[int]:
    if rng.random() < 0.5:
        return contiguous_stride(shape)
    return [rng.choice(STRIDE_EDGES) for _ in shape]


def all_cases() -> list[tuple[str, Any, dict[str, Any]]]:
    rng = random.Random(0x5EED_0503)
    out: list[tuple[str, Any, dict[str, Any]]] = []

    def cpu(*a: Any) -> None:
        out.append(("v0_5_3_cpu_shm", *cpu_case(*a)))

    def raw(*a: Any) -> None:
        out.append(("v0_5_3_raw_cuda", *raw_cuda_case(*a)))

    def ipc(*a: Any) -> None:
        out.append(("v0_5_3_cuda_ipc", *cuda_ipc_case(*a)))

    # The reference disassembly of the protocol doc (section 4.3), 245 bytes.
    cpu("/lmcache_kv_1234_0", 131072, "float16", [2, 4, 8, 16, 64],
        [65536, 16384, 2048, 64, 1], 0)
    # A realistic vLLM layer (contiguous, nbytes = numel * itemsize) for every dtype.
    for i, dtype in enumerate(DTYPES):
        shape = [2, 1 + i, 16, 8, 128]
        itemsize = getattr(torch, dtype).itemsize
        cpu(f"/lmcache_kv_{4242 + i}_{i}", numel(shape) * itemsize, dtype, shape,
            contiguous_stride(shape), 0)
    # 0-D to 8-D, every nbytes / offset boundary.
    for ndim in range(0, 9):
        shape = rand_shape(rng, ndim)
        cpu(rand_shm_name(rng, rng.randint(1, 40)), rng.choice(NBYTES), rng.choice(DTYPES),
            shape, rand_stride(rng, shape), rng.choice(OFFSETS))
    for nbytes in NBYTES:
        cpu("/n", nbytes, "bfloat16", [3], [1], 0)
    for off in OFFSETS:
        cpu("/lmcache_kv_1_0", 64, "uint8", [8, 8], [8, 1], off)
    # Every stride encoding, incl. negative and int64 extremes; shape == stride contents.
    for k in range(0, len(STRIDE_EDGES), 4):
        stride = STRIDE_EDGES[k:k + 4]
        cpu(rand_shm_name(rng, 12), 1024, "float32", [4] * len(stride), stride, 0)
    cpu("/same", 4, "int8", [1], [1], 0)
    cpu("/same3", 64, "int8", [4, 4, 4], [4, 4, 4], 0)
    cpu("/empty", 0, "float16", [], [], 0)
    cpu("/z", 0, "float16", [0, 128], [128, 1], 0)
    # Names: 1 char, 250 chars (the maximum we allow), every allowed character.
    cpu("/a", 2, "float16", [1], [1], 0)
    cpu(rand_shm_name(rng, 250), 2**33, "float8_e4m3fn", [2, 2], [2, 1], 0)
    cpu("/" + SHM_CHARS, 10, "uint8", [10], [1], 0)
    cpu("/.hidden-name_x.y", 10, "uint8", [10], [1], 0)

    handles = [bytes(64), b"\xff" * 64, bytes(range(64)), bytes(rng.randrange(256) for _ in range(64))]
    for i, h in enumerate(handles):
        shape = rand_shape(rng, 1 + i)
        raw(h, rng.choice(NBYTES), rng.choice(DTYPES), shape, rand_stride(rng, shape),
            rng.choice(OFFSETS), UUIDS[i % len(UUIDS)])
    for nbytes in [0, 255, 65536, 2**31, 2**32, 2**40, 2**63 - 1]:
        raw(handles[3], nbytes, "float16", [2, 16, 8, 128], [16384, 1024, 128, 1], 0, UUIDS[2])
    raw(handles[2], 2**33, "bfloat16", [], [], 0, UUIDS[3])
    for _ in range(8):
        ndim = rng.randint(0, 8)
        shape = rand_shape(rng, ndim)
        raw(bytes(rng.randrange(256) for _ in range(64)), rng.choice(NBYTES),
            rng.choice(DTYPES), shape, rand_stride(rng, shape), rng.choice(OFFSETS),
            str(uuid.UUID(int=rng.getrandbits(128))))

    # CudaIPCWrapper: the 8-tuple of _share_cuda_() (torch's 66-byte versioned handle or
    # a bare 64-byte cudaIpcMemHandle_t), with both bools.
    for i in range(8):
        storage = (bytes([2 + i % 2]) + b"c" + bytes(rng.randrange(256) for _ in range(64))
                   if i % 2 else bytes(rng.randrange(256) for _ in range(64)))
        ref = (f"/torch_{rng.randrange(10**6)}_{rng.randrange(10**9)}_{i}".encode()
               if i != 3 else b"/")
        handle = [rng.choice([0, 1, 7, 255, 256]), storage, rng.choice(NBYTES),
                  rng.choice(OFFSETS), ref, rng.choice([0, 8, 256, 70000, 2**32]),
                  bytes(rng.randrange(256) for _ in range(64)) if i % 3 else bytes(64),
                  bool(i % 2)]
        shape = rand_shape(rng, rng.randint(0, 6))
        ipc(handle, rng.choice(DTYPES), shape, rand_stride(rng, shape),
            rng.choice(OFFSETS), UUIDS[i % len(UUIDS)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fixtures", help="fixtures root (default: fixtures)")
    args = ap.parse_args()
    version = importlib.metadata.version("lmcache")
    cases = []
    for template, obj, fields in all_cases():
        data = pickle.dumps(obj)
        # Our emitter never writes BINGET; if the real pickle did, that assumption broke.
        ops = {op.name for op, _, _ in pickletools.genops(data)}
        if ops & {"BINGET", "LONG_BINGET", "GET"}:
            raise SystemExit(f"unexpected memo reference in {template} {fields}")
        cases.append({"template": template, "fields": fields, "pickle": data.hex()})
    doc = {
        "meta": {
            "generator": "tools/gen_pickle_fixtures.py",
            "lmcache": version,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "pickle_protocol": pickle.DEFAULT_PROTOCOL,
            "fields": "the instance __dict__ in pickle order; bytes as {\"$bytes\": hex}, "
                      "tuples as lists, dtype as its torch attribute name",
        },
        "cases": cases,
    }
    path = Path(args.out) / f"v{version}" / "pickles.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
