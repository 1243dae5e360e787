#!/usr/bin/env python3
"""Write byte fixtures with LMCache's OWN encoder and hasher (run in an oracle venv).

    scripts/lmcache-server.sh python --version V -- tools/gen_fixtures.py [--out fixtures]

Works with LMCache 0.5.3, 0.5.4, 0.5.5, 0.5.6 and 0.5.7rc2 (0.5.6+ has no RequestType
enum: its ops are method names with a frozen table of legacy ids; 0.5.7 keys carry
``token_bytes``, packed by its own ``token_codec``); writes fixtures/v<V>/.

For every operation of the engine, controller, debug and observability groups it
encodes several representative payloads with ``lmcache.v1.multiprocess.mq.msgspec_encode``
and the real payload classes, and representative replies with the real response
classes; it also records the server's token hashes and kv ranks. Unit tests compare
lmcache_mp's frames with these bytes and decode these replies without lmcache.

wrappers.json holds every KV-cache wrapper form (CPU SHM, raw CUDA, torch CUDA IPC)
serialised by the release's own ``DeviceIPCWrapper.Serialize`` and read back by its
``Deserialize``; events.json the completion-event handles a reply can carry instead of
a cudaIpcEventHandle_t (CPU stub, 0.5.5+ timeline semaphore). ``--only wrappers``
writes just those two files.

Payload values are written as tagged JSON so the tests can rebuild them with
lmcache_mp's types: {"$key": {...}}, {"$bytes": hex}, {"$float": x},
{"$wrappers": [pickle hex, ...]}, {"$hints": {...}}, {"$groups": [...]},
{"$records": [...]}, {"$engine_driven": {...}}, {"$engine": "vllm"}, and for replies
{"$struct": {field: value}} with {"$json": plain JSON} for free-form maps.
"""

from __future__ import annotations

import argparse
import json
import random
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import msgspec
import torch
from lmcache.utils import EngineType
from lmcache.v1.distributed.api import ipc_key_to_object_keys
from lmcache.v1.multiprocess.custom_types import (
    BlockAllocationRecord,
    IPCCacheServerKey,
    RegisterEngineDrivenContextPayload,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.token_hasher import TokenHasher

VERSION = dist_version("lmcache")
FAMILY = {"0.5.3": "0.5.3", "0.5.4": "0.5.3", "0.5.5": "0.5.5", "0.5.6": "0.5.6"}.get(
    VERSION, "0.5.7" if VERSION.startswith("0.5.7") else VERSION)
# 0.5.6 and later: method-name operations, msgspec descriptors instead of pickles.
RPC = FAMILY in ("0.5.6", "0.5.7")
PACKED = FAMILY == "0.5.7"  # keys carry token_bytes
if PACKED:
    from lmcache.v1.multiprocess.custom_types import GroupLayout
    from lmcache.v1.multiprocess.token_codec import pack_token_ids, unpack_token_ids

if RPC:
    # 0.5.6: no RequestType enum; ops are method names with frozen legacy ids.
    from lmcache.v1.multiprocess.custom_types import (
        PrepareRetrieveResponse,
        PrepareStoreResponse,
        RegisterEngineDrivenContextResponse,
    )
    from lmcache.v1.multiprocess.rpc import get_rpc_spec
    from lmcache.v1.multiprocess.transport.zmq_impl.mq import msgspec_encode
    from lmcache.v1.multiprocess.transport.zmq_impl.wire import (
        LEGACY_OPERATION_IDS,
        encode_operation,
    )
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper
    from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubEvent
    from lmcache.v1.platform.devices.cuda import timeline_semaphore_event_ipc as timeline
    from lmcache.v1.platform.devices.cuda.ipc_wrapper import CudaIPCWrapper, RawCudaIPCWrapper

    def payload_classes(op: str) -> list[Any]:
        return list(get_rpc_spec(op.lower()).payload_types)

    def response_class(op: str) -> Any:
        rt = get_rpc_spec(op.lower()).response_type
        return None if rt is type(None) else rt

    def type_frame(op: str) -> bytes:
        return encode_operation(op.lower())

    def op_id(op: str) -> int:
        return LEGACY_OPERATION_IDS[op.lower()]
else:
    from lmcache.v1.multiprocess.mq import msgspec_encode
    from lmcache.v1.multiprocess.protocol import get_payload_classes, get_response_class
    from lmcache.v1.multiprocess.protocols.base import RequestType
    from lmcache.v1.multiprocess.protocols.engine import (
        PrepareRetrieveResponse,
        PrepareStoreResponse,
        RegisterEngineDrivenContextResponse,
    )
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.cpu.shm import CpuShmTensorWrapper
    from lmcache.v1.platform.cpu.stub_cpu_device import StubEvent
    from lmcache.v1.platform.cuda.ipc_wrapper import CudaIPCWrapper, RawCudaIPCWrapper

    if FAMILY == "0.5.5":  # --isolated-ipc's event backend appeared in 0.5.5
        from lmcache.v1.platform.cuda import timeline_semaphore_event_ipc as timeline
    else:
        timeline = None

    def payload_classes(op: str) -> list[Any]:
        return list(get_payload_classes(RequestType[op]))

    def response_class(op: str) -> Any:
        return get_response_class(RequestType[op])

    def type_frame(op: str) -> bytes:
        return msgspec_encode(RequestType[op], RequestType)

    def op_id(op: str) -> int:
        return int(RequestType[op].value)

GROUPS = {
    "engine": [
        "REGISTER_KV_CACHE", "UNREGISTER_KV_CACHE", "REGISTER_Q_CACHE", "UNREGISTER_Q_CACHE",
        "STORE_Q", "STORE", "RETRIEVE", "LOOKUP", "QUERY_PREFETCH_STATUS",
        "WAIT_PREFETCH_STATUS", "QUERY_PREFETCH_LOOKUP_HITS", "FREE_LOOKUP_LOCKS",
        "END_SESSION", "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
        "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", "PREPARE_STORE", "COMMIT_STORE",
        "PREPARE_RETRIEVE", "COMMIT_RETRIEVE",
    ],
    "controller": ["CLEAR", "GET_CHUNK_SIZE", "PING", "GET_EXPERIMENTAL"],
    "observability": ["REPORT_BLOCK_ALLOCATION"],
    "debug": ["NOOP"],
}

rng = random.Random(20261130)


# ---------------------------------------------------------------- value tagging
def tag(value: Any) -> Any:
    if isinstance(value, IPCCacheServerKey):
        fields = {
            "model_name": value.model_name, "world_size": value.world_size,
            "worker_id": value.worker_id, **token_field(value),
            "start": value.start, "end": value.end, "request_id": value.request_id,
            "cache_salt": value.cache_salt,
        }
        if FAMILY != "0.5.3":
            fields["request_configs"] = value.request_configs
            fields["num_kv_readers"] = value.num_kv_readers
        return {"$key": fields}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, float):
        return {"$float": value}
    if isinstance(value, EngineType):
        return {"$engine": value.value}
    if isinstance(value, RegisterEngineDrivenContextPayload):
        return {"$engine_driven": msgspec.to_builtins(value)}
    if isinstance(value, list) and value and isinstance(value[0], DeviceIPCWrapper):
        # The release's own serialiser: a pickle up to 0.5.5, a descriptor in 0.5.6.
        return {"$wrappers": [DeviceIPCWrapper.Serialize(w).hex() for w in value]}
    if isinstance(value, list) and value and isinstance(value[0], EngineGroupInfo):
        return {"$groups": [msgspec.to_builtins(g) for g in value]}
    if isinstance(value, list) and value and isinstance(value[0], BlockAllocationRecord):
        return {"$records": [
            {"req_id": r.req_id, "new_block_ids": r.new_block_ids,
             "new_token_ids": r.new_token_ids} for r in value
        ]}
    if isinstance(value, dict):
        return {"$hints": value}
    if isinstance(value, tuple):
        return [tag(v) for v in value]
    if isinstance(value, list):
        return [tag(v) for v in value]
    if isinstance(value, (PrepareStoreResponse, PrepareRetrieveResponse,
                          RegisterEngineDrivenContextResponse)):
        return {"$struct": {k: ({"$json": v} if isinstance(v, dict) else tag(v))
                            for k, v in vars(value).items()}}
    return value


def token_field(k: IPCCacheServerKey) -> dict[str, Any]:
    """The key's token field as tagged JSON: the id list, or 0.5.7's packed bytes."""
    if PACKED:
        return {"token_bytes": {"$bytes": k.token_bytes.hex()}}
    return {"token_ids": list(k.token_ids)}


def tokens_arg(tokens: list[int]) -> dict[str, Any]:
    """The constructor argument for ``tokens``, packed by the release's own codec."""
    return {"token_bytes": pack_token_ids(tokens)} if PACKED else {"token_ids": tuple(tokens)}


def key_tokens(k: IPCCacheServerKey) -> list[int]:
    return unpack_token_ids(k.token_bytes) if PACKED else list(k.token_ids)


# ------------------------------------------------------------- representative values
def key(tokens: list[int], *, worker_id: int | None = 0, start: int = 0, end: int | None = None,
        model: str = "m", world_size: int = 1, request_id: str = "r", salt: str = "") -> IPCCacheServerKey:
    extra: dict[str, Any] = {}
    if FAMILY != "0.5.3":
        # What LMCache's own adapter sends: one reader, or more for MLA over TP.
        extra["num_kv_readers"] = 1 + (world_size > 1 and worker_id is None)
    return IPCCacheServerKey(
        model_name=model, world_size=world_size, worker_id=worker_id, **tokens_arg(tokens),
        start=start, end=len(tokens) if end is None else end, request_id=request_id,
        cache_salt=salt, **extra,
    )


def keys(worker: bool) -> list[IPCCacheServerKey]:
    w = 0 if worker else None
    long = [rng.randrange(0, 2**32) for _ in range(4096)]
    return [
        key([1, 2], worker_id=w, start=0, end=2),  # the reference's K0 / KN shape
        key([], worker_id=w, start=0, end=0, request_id=""),
        key(long, worker_id=(3 if worker else None), world_size=4, start=256, end=4096,
            request_id="req-" + "x" * 40),
        key([0, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1] * 30, worker_id=w,
            start=0, end=256, salt="tenant-42_salt.v1"),
        key(list(range(512)), worker_id=w, model="模型/llama-3.1 ✓ " + "é" * 40,
            request_id="ünïcode-✓", salt="s" * 128),
    ]


def shm_wrapper(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> CpuShmTensorWrapper:
    w = object.__new__(CpuShmTensorWrapper)
    numel = 1
    for d in shape:
        numel *= d
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    w.shm_name = name
    w.nbytes = numel * torch.empty((), dtype=dtype).element_size()
    w.handle = None
    w.dtype = dtype
    w.shape = tuple(shape)
    w.stride = tuple(reversed(strides))
    w.storage_offset = 0
    w.device_uuid = "cpu"
    return w


def register_payloads() -> list[list[Any]]:
    one = [shm_wrapper("/lmcache_kv_1234_0", (2, 4, 8, 16, 64), torch.float16)]
    two = [shm_wrapper(f"/lmcache_mp_99_{i}", (2, 64, 4, 16, 32), torch.bfloat16) for i in range(2)]
    mla = [shm_wrapper("/x", (128, 16, 576), torch.float32)]
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=(0, 1), tokens_per_block=16)]
    return [
        [7, one, "m", 1, EngineType.VLLM, {"kv_layout": "HND"}, []],
        [2**63 - 1, two, "模型 ✓", 2, EngineType.VLLM, {"kv_layout": "HND"}, groups],
        [0, mla, "mla-model", 1, EngineType.SGLANG, {}, [EngineGroupInfo(engine_group_id=0)]],
        [123456789, one, "m", 8, EngineType.TRTLLM,
         {"kv_layout": "NHD", "num_kv_heads": 8, "tokens_per_block": 32, "head_dim": 128},
         [EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=32,
                          sw_size_tokens=4096),
          EngineGroupInfo(engine_group_id=1, layer_indices=(), tokens_per_block=0)]],
        [-5, one, "", 1, EngineType.MOCK, {"tokens_per_block": 16}, []],
    ]


EVENTS = [b"", bytes(range(64)), b"\xff" * 300, bytes(70000)]
BLOCKS = [[[0, 1]], [list(range(256))], [[0, 1, 2], [70000, 2**40]], [[]]]
INSTANCES = [7, 0, 2**63 - 1, -1, 65536]
REQUEST_IDS = ["r", "", "req-" + "y" * 300, "ünïcode-✓"]


def payload_sets(op: str) -> list[list[Any]]:
    wkeys, nkeys = keys(True), keys(False)
    if op in ("REGISTER_KV_CACHE", "REGISTER_Q_CACHE"):
        return register_payloads()
    if op in ("UNREGISTER_KV_CACHE", "UNREGISTER_Q_CACHE",
              "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT"):
        return [[i] for i in INSTANCES]
    if op in ("STORE", "STORE_Q"):
        return [[k, INSTANCES[i % 5], BLOCKS[i % 4], EVENTS[i % 4]] for i, k in enumerate(wkeys)]
    if op == "RETRIEVE":
        return [[k, INSTANCES[i % 5], BLOCKS[i % 4], EVENTS[i % 4], [0, 16, 255, 4096, 2**40][i]]
                for i, k in enumerate(wkeys)]
    if op == "FREE_LOOKUP_LOCKS" and PACKED:  # 0.5.7: extra_ranges (default ())
        ranges: list[Any] = [(), ((0, 256),), (), ((0, 16), (256, 4096)), ((2**40, 2**40 + 1),)]
        return [[k, [1, 2, 8, 1, 64][i], ranges[i]] for i, k in enumerate(nkeys)]
    if op in ("LOOKUP", "FREE_LOOKUP_LOCKS"):
        return [[k, [1, 2, 8, 1, 64][i]] for i, k in enumerate(nkeys)]
    if op in ("QUERY_PREFETCH_STATUS", "QUERY_PREFETCH_LOOKUP_HITS", "END_SESSION"):
        return [[r] for r in REQUEST_IDS]
    if op == "WAIT_PREFETCH_STATUS":
        return [["r", 5.0], ["", 0.001], ["req-" + "y" * 300, 3600.5], ["ünïcode-✓", 1e-9]]
    if op == "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT":
        return [
            [RegisterEngineDrivenContextPayload(7, "m", 1, 16, 2, 128, "float16", False)],
            [RegisterEngineDrivenContextPayload(2**63 - 1, "模型 ✓", 8, 64, 80, 8192,
                                                "bfloat16", True)],
            [RegisterEngineDrivenContextPayload(0, "", 1, 1, 1, 1, "float32", False)],
        ] + ([[RegisterEngineDrivenContextPayload(
            5, "hybrid", 2, 16, 4, 1024, "bfloat16", False, num_physical_slots=64,
            group_layouts=[GroupLayout(3, 1024, "bfloat16", 16),
                           GroupLayout(1, 512, "float16", 32, 4096, 1, 2, True)])]]
            if PACKED else [])
    if op == "PREPARE_STORE" and PACKED:  # 0.5.7: skipped_chunks (default ())
        skipped: list[Any] = [(), ((1, 2),), ((), (0,)), (), ((0, 1, 2, 3, 2**33),)]
        return [[k, INSTANCES[i % 5], skipped[i]] for i, k in enumerate(wkeys)]
    if op in ("PREPARE_STORE", "PREPARE_RETRIEVE", "COMMIT_RETRIEVE"):
        return [[k, INSTANCES[i % 5]] for i, k in enumerate(wkeys)]
    if op == "COMMIT_STORE":
        return [[k, INSTANCES[i % 5], EVENTS[i % 4]] for i, k in enumerate(wkeys)]
    if op == "CLEAR" and RPC:
        return [[True], [False]]
    if op in ("CLEAR", "GET_CHUNK_SIZE", "GET_EXPERIMENTAL", "NOOP"):
        return [[]]
    if op == "PING":
        return [[None], [7], [2**63 - 1], [0]]
    if op == "REPORT_BLOCK_ALLOCATION":
        return [
            [7, "m", [BlockAllocationRecord("r", [3], [9])]],
            [2**63 - 1, "模型 ✓", [BlockAllocationRecord("a", list(range(300)), [2**32 - 1] * 20),
                                  BlockAllocationRecord("", [], [])]],
            [0, "m", []],
        ]
    raise KeyError(op)


def reply_values(op: str) -> list[Any]:
    """Values the server's handlers return; None is the 2-frame acknowledgement."""
    cls = response_class(op)
    if cls is None:
        return [None]
    slots = {"slots": [{"offset": 0, "length": 262144, "shape": [2, 2, 256, 128],
                        "dtype": "float16"},
                       {"offset": 2**33, "length": 262144, "shape": [2, 2, 256, 128],
                        "dtype": "bfloat16"}],
             "chunk_indices": [0, 3]}
    table: dict[str, list[Any]] = {
        "STORE": [(b"stub_ipc_handle", True), (bytes(64), False)],
        "RETRIEVE": [(b"stub_ipc_handle", True), (b"", False)],
        "STORE_Q": [(b"stub_ipc_handle", True)],
        "QUERY_PREFETCH_STATUS": [0, 1, 16, 2**40, None],
        "WAIT_PREFETCH_STATUS": [0, 3, None],
        "QUERY_PREFETCH_LOOKUP_HITS": [0, 7, None],
        "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT": [
            RegisterEngineDrivenContextResponse("lmcache_l1_pool_42", 1073741824),
            RegisterEngineDrivenContextResponse(),
        ],
        "PREPARE_STORE": [PrepareStoreResponse(context=slots), PrepareStoreResponse(),
                          PrepareStoreResponse(context={"slots": [], "chunk_indices": []})],
        "COMMIT_STORE": [True, False],
        "PREPARE_RETRIEVE": [PrepareRetrieveResponse(True, b"", {"slots": slots["slots"]}),
                             PrepareRetrieveResponse(False),
                             PrepareRetrieveResponse(True, b"\x80\x04pickled", {})],
        "COMMIT_RETRIEVE": [True, False],
        "GET_CHUNK_SIZE": [256, 16, 65536],
        "PING": [True],
        "GET_EXPERIMENTAL": [[], ["transfer_query"], ["a", "ünï"]],
        "NOOP": ["OK"],
    }
    return table[op]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def raw_cuda_wrapper(handle: bytes, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
                     uuid: str, alloc_offset: int = 0) -> Any:
    """A RawCudaIPCWrapper as __init__ would leave it (no GPU needed)."""
    w = object.__new__(RawCudaIPCWrapper)
    attrs: dict[str, Any] = {"_ipc_handle_reserved": handle}
    if FAMILY != "0.5.3":
        attrs["_alloc_offset"] = alloc_offset
    attrs.update(_nbytes=nbytes, handle=None, dtype=dtype, shape=tuple(shape),
                 stride=_contiguous(shape), storage_offset=0)
    if FAMILY != "0.5.3":
        attrs["_opens"] = 0
    attrs["device_uuid"] = uuid
    for k, v in attrs.items():
        setattr(w, k, v)
    return w


# What lmcache_mp's torch_ipc form puts in torch's _share_cuda_() 8-tuple besides the
# layer's own values (lmcache_mp/protocol/wrappers.py torch_storage_handle): a
# ref-counter file name that cannot exist, no producer event. Kept here, not imported:
# this tool is the oracle and never imports lmcache_mp.
NO_REFCOUNTER = b"/lmcache_mp_no_refcounter_file"


def cuda_ipc_wrapper(device_index: int, handle: bytes, nbytes: int, alloc_offset: int,
                     dtype: torch.dtype, shape: tuple[int, ...], uuid: str) -> Any:
    """A CudaIPCWrapper as __init__ leaves it for a contiguous tensor whose storage
    starts ``alloc_offset`` bytes into its allocation (no GPU needed)."""
    w = object.__new__(CudaIPCWrapper)
    storage = (device_index, handle, nbytes, alloc_offset, NO_REFCOUNTER, 0, bytes(64), False)
    for k, v in (("handle", storage), ("dtype", dtype), ("shape", tuple(shape)),
                 ("stride", _contiguous(shape)), ("storage_offset", 0),
                 ("device_uuid", uuid)):
        setattr(w, k, v)
    return w


def checked_serialize(wrapper: Any) -> bytes:
    """The release's own serialisation, proven to open again with its own decoder (a
    0.5.6 descriptor's validation, or the pickle the server loads; oracle venv only)."""
    data = DeviceIPCWrapper.Serialize(wrapper)
    back = DeviceIPCWrapper.Deserialize(data)
    assert type(back) is type(wrapper) and back == wrapper, (wrapper, back)
    return bytes(data)


def wrapper_cases() -> list[dict[str, Any]]:
    """Each wrapper serialised by the release's own ``DeviceIPCWrapper.Serialize``:
    kinds cpu_shm, cuda_raw (0.5.5+ with offsets too) and cuda_ipc (lmcache_mp's
    ``torch_ipc`` form; the ``cuda`` descriptor in 0.5.6)."""
    cases = []
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]
    shapes = [(2, 64, 4, 16, 32), (128, 16, 576), (2, 1, 1, 1, 1), (2, 4096, 8, 16, 128), ()]
    offsets = [0, 0, 512, 2**20, 2**33 + 256]
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * itemsize
        name = f"/lmcache_mp_{1000 + i}_{i}_L{i}_{'ab' * i}"
        w = shm_wrapper(name, shape, dtype)
        cases.append({"kind": "cpu_shm", "fields": {
            "shm_name": name, "nbytes": w.nbytes, "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape), "stride": list(w.stride)},
            "data": DeviceIPCWrapper.Serialize(w).hex()})
        handle = bytes((i * 37 + j) % 256 for j in range(64))
        uuid = f"{i:08x}-1234-5678-9abc-{i * 99991:012x}"
        common = {"ipc_handle": handle.hex(), "nbytes": nbytes,
                  "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                  "stride": list(_contiguous(shape)), "device_uuid": uuid}
        # 0.5.3's RawCudaIPCWrapper has no offset field: base pointers only.
        for off in sorted({0, offsets[i]} if FAMILY != "0.5.3" else {0}):
            rw = raw_cuda_wrapper(handle, nbytes, dtype, shape, uuid, off)
            cases.append({"kind": "cuda_raw", "fields": {**common, "alloc_offset": off},
                          "data": checked_serialize(rw).hex()})
        device_index = i % 3
        cw = cuda_ipc_wrapper(device_index, handle, nbytes, offsets[i], dtype, shape, uuid)
        cases.append({"kind": "cuda_ipc", "fields": {
            **common, "alloc_offset": offsets[i], "device_index": device_index},
            "data": checked_serialize(cw).hex()})
    return cases + (vmm_cases() if RPC else [])


def vmm_cases() -> list[dict[str, Any]]:
    """0.5.6+: ``VmmCudaIPCWrapper`` descriptors (``cuda_vmm``), both kinds, as the
    release's own ``from_wire`` restores them and its ``Serialize`` writes them (a
    wrapper's own ``__init__`` needs a GPU; the fd never rides the descriptor)."""
    from lmcache.v1.platform.base.ipc_wire import TensorMetadata, VmmCudaIPCData
    from lmcache.v1.platform.devices.cuda.ipc_wrapper import VmmCudaIPCWrapper

    cases = []
    rows = [("posix_fd", None, torch.bfloat16, (2, 64, 4, 16, 32), 2**21, 0),
            ("posix_fd", None, torch.float16, (128, 16, 576), 2**30, 2**29 + 4096),
            ("fabric", bytes(range(64)), torch.float32, (2, 1, 1, 1, 1), 2**21, 512),
            ("fabric", b"\xff" * 64, torch.float8_e4m3fn, (2, 4096, 8, 16, 128), 2**34, 0)]
    for i, (kind, blob, dtype, shape, alloc_size, offset) in enumerate(rows):
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        export_id = bytes((i * 17 + j) % 256 for j in range(16))
        uuid = f"{i:08x}-aaaa-bbbb-cccc-{i * 7919:012x}"
        meta = TensorMetadata(dtype=str(dtype).removeprefix("torch."), shape=shape,
                              stride=_contiguous(shape), storage_offset=0, device_uuid=uuid)
        data = VmmCudaIPCData(version=1, metadata=meta, export_id=export_id, kind=kind,
                              fabric_blob=blob, alloc_size=alloc_size, alloc_offset=offset,
                              nbytes=nbytes)
        wrapper = VmmCudaIPCWrapper.from_wire(data)
        cases.append({"kind": "cuda_vmm", "fields": {
            "export_id": export_id.hex(), "vmm_kind": kind,
            "fabric_blob": None if blob is None else blob.hex(), "alloc_size": alloc_size,
            "alloc_offset": offset, "nbytes": nbytes, "dtype": meta.dtype,
            "shape": list(shape), "stride": list(meta.stride), "device_uuid": uuid},
            "data": checked_serialize(wrapper).hex()})
    return cases


def event_cases() -> list[dict[str, Any]]:
    """Completion-event handles a STORE / RETRIEVE reply can carry besides a 64-byte
    cudaIpcEventHandle_t: a CPU-mode server's stub, and (0.5.5+, --isolated-ipc) the
    timeline-semaphore handle, packed with the release's own wire struct."""
    cases = [{"kind": "cpu_stub", "data": StubEvent(interprocess=True).ipc_handle().hex()}]
    if timeline is not None:
        for n, (slot, seq) in enumerate([(8, 1), (8 * 4095, 2**40), (0, 0)]):
            mem = bytes((n * 11 + j) % 256 for j in range(64))
            data = timeline._EXPORT_STRUCT.pack(timeline._HANDLE_VERSION, mem, slot, seq)
            cases.append({"kind": "timeline_semaphore", "data": data.hex(),
                          "fields": {"version": timeline._HANDLE_VERSION, "slot_offset": slot,
                                     "seq": seq}})
    return cases


# ------------------------------------------------------------- key building
# Deployments whose keys the release's own vLLM adapter code describes: (MLA?, TP, PP).
# MLA replicates KV over TP, so the KV world size shrinks and readers grow; the last two
# MLA rows (TP <= PP) are where 0.5.5's reader count and 0.5.3's rule part ways.
DEPLOYMENTS = [(False, 1, 1), (False, 2, 1), (False, 4, 1), (False, 2, 2), (False, 1, 4),
               (True, 2, 1), (True, 4, 1), (True, 8, 1), (True, 4, 2), (True, 8, 2),
               (True, 2, 4), (True, 4, 4)]
SALTS = ["", "tenant-42", "s" * 128, "user_7.salt-v2"]


def server_read_locks(lookup_key: IPCCacheServerKey, tp_payload: int) -> int:
    """Read locks the release's server takes per looked-up object (its own code)."""
    if FAMILY == "0.5.3":
        from lmcache.v1.multiprocess.modules.lookup import compute_extra_count

        return 1 + compute_extra_count(tp_payload, lookup_key.world_size)
    return lookup_key.require_num_kv_readers()


def adapter_key(strategy: Any, tokens: list[int], *, worker_id: int | None, start: int,
                end: int, request_id: str, salt: str, model: str) -> IPCCacheServerKey:
    """What the release's vLLM adapter's ``_create_key`` builds (lookups then drop the
    worker id with ``no_worker_id_version``)."""
    extra: dict[str, Any] = {}
    if FAMILY != "0.5.3":
        extra["num_kv_readers"] = strategy.num_kv_readers
    return IPCCacheServerKey(model_name=model, world_size=strategy.kv_world_size,
                             worker_id=worker_id, **tokens_arg(tokens), start=start,
                             end=end, request_id=request_id, cache_salt=salt, **extra)


def object_key_rows(k: IPCCacheServerKey, chunk_size: int) -> list[dict[str, Any]]:
    """The server's ObjectKeys for a key's range (as FREE_LOOKUP_LOCKS / STORE derive
    them: hashes of ``[start, end)``, rolling from token 0), with each one's chunk index
    found in the full hash list."""
    hasher = TokenHasher(chunk_size=chunk_size, hash_algorithm="blake3")
    every = hasher.compute_chunk_hashes(key_tokens(k))
    hashes = hasher.compute_chunk_hashes(key_tokens(k), start=k.start, end=k.end)
    return [{"chunk_index": every.index(ok.chunk_hash), "chunk_hash": ok.chunk_hash.hex(),
             "kv_rank": ok.kv_rank, "model_name": ok.model_name, "cache_salt": ok.cache_salt}
            for ok in ipc_key_to_object_keys(k, hashes, [0])[0]]


def key_plain(k: IPCCacheServerKey) -> dict[str, Any]:
    return tag(k)["$key"]  # type: ignore[no-any-return]


def key_cases() -> list[dict[str, Any]]:
    from lmcache.integration.vllm.vllm_multi_process_adapter import ParallelStrategy

    lookup_cls, free_cls = payload_classes("LOOKUP"), payload_classes("FREE_LOOKUP_LOCKS")
    store_cls = payload_classes("STORE")
    cases = []
    krng = random.Random(20261201)
    for n, (mla, tp, pp) in enumerate(DEPLOYMENTS):
        for worker in sorted({0, tp * pp - 1}):
            strategy = ParallelStrategy(mla_only=mla, vllm_world_size=tp * pp,
                                        vllm_worker_id=worker, tp_size=tp, pp_size=pp,
                                        n_servers=1)
            chunk = 256 if n == 0 and worker == 0 else 16
            tokens = [krng.randrange(0, 2**32) for _ in range(4 * chunk + 5)]
            start, end = [(chunk, 3 * chunk), (2 * chunk, 4 * chunk), (0, chunk),
                          (3 * chunk, 4 * chunk)][(n + worker) % 4]
            salt = SALTS[(n + worker) % len(SALTS)]
            model = "模型-llama ✓" if n % 5 == 4 else "m"
            rid = f"req-{n}-{worker}"
            whole = adapter_key(strategy, tokens, worker_id=None, start=0,
                                end=len(tokens) - len(tokens) % chunk, request_id=rid,
                                salt=salt, model=model)
            ranged = adapter_key(strategy, tokens, worker_id=strategy.kv_worker_id,
                                 start=start, end=end, request_id=rid, salt=salt, model=model)
            free = ranged.no_worker_id_version()
            if FAMILY != "0.5.3":  # no_worker_id_version keeps the readers from 0.5.5 on
                assert free.num_kv_readers == ranged.num_kv_readers
            tp_payload = strategy.kv_tp_size  # what the adapter sends with LOOKUP / FREE
            cases.append({
                "name": f"{'mla' if mla else 'mha'}-tp{tp}-pp{pp}-w{worker}",
                "mla": mla, "tp": tp, "pp": pp, "vllm_worker_id": worker,
                "kv_world_size": strategy.kv_world_size, "kv_worker_id": strategy.kv_worker_id,
                "tp_size": tp_payload, "chunk_size": chunk,
                "model_name": model, "token_ids": tokens, "start": start, "end": end,
                "request_id": rid, "cache_salt": salt,
                "lookup": {"key": key_plain(whole),
                           "frames": [msgspec_encode(whole, lookup_cls[0]).hex(),
                                      msgspec_encode(tp_payload, lookup_cls[1]).hex()],
                           "read_locks": server_read_locks(whole, tp_payload)},
                "free": {"key": key_plain(free),
                         # 0.5.7's adapter sends extra_ranges too (here its default)
                         "frames": [msgspec_encode(free, free_cls[0]).hex(),
                                    msgspec_encode(tp_payload, free_cls[1]).hex()]
                         + ([msgspec_encode((), free_cls[2]).hex()] if PACKED else []),
                         "object_keys": object_key_rows(free, chunk)},
                "transfer": {"key": key_plain(ranged),
                             "frames": [msgspec_encode(ranged, store_cls[0]).hex()],
                             "object_keys": object_key_rows(ranged, chunk)},
            })
    return cases


# ----------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fixtures")
    ap.add_argument("--only", choices=["all", "wrappers"], default="all",
                    help="wrappers: write only wrappers.json and events.json")
    args = ap.parse_args()
    version = VERSION
    out = Path(args.out) / f"v{version}"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"lmcache_version": version, "msgspec_version": msgspec.__version__,
            "generator": "tools/gen_fixtures.py"}
    outputs = [("wrappers", wrapper_cases()), ("events", event_cases())]
    if args.only == "all":
        outputs += requests_replies_hashes()
    for name, data in outputs:
        path = out / f"{name}.json"
        path.write_text(json.dumps({"meta": meta, "cases": data}, ensure_ascii=False, indent=0) + "\n")
        print(f"wrote {path}: {len(data)} cases")


def requests_replies_hashes() -> list[tuple[str, list[dict[str, Any]]]]:
    """Every op's request frames and replies, and the server's token hashes."""
    requests, replies = [], []
    uid_cycle = [5, 0, 2**31, 127]
    for group, ops in GROUPS.items():
        for op in ops:
            if op == "QUERY_PREFETCH_LOOKUP_HITS" and RPC:
                continue  # retired in 0.5.6
            classes = payload_classes(op)
            for n, payloads in enumerate(payload_sets(op)):
                assert len(payloads) == len(classes), (op, payloads)
                uid = uid_cycle[n % len(uid_cycle)]
                frames = [msgspec_encode(uid, int), type_frame(op)]
                frames += [msgspec_encode(p, c) for p, c in zip(payloads, classes, strict=True)]
                requests.append({
                    "op": op, "group": group, "id": op_id(op), "uid": uid,
                    "payloads": [tag(p) for p in payloads],
                    "frames": [f.hex() for f in frames],
                })
            cls = response_class(op)
            for n, value in enumerate(reply_values(op)):
                frames = [msgspec_encode(n, int), type_frame(op)]
                if value is not None:
                    frames.append(msgspec_encode(value, cls))
                replies.append({"op": op, "value": tag(value),
                                "frames": [f.hex() for f in frames]})

    hasher_cases = []
    token_lists = {
        "empty": [],
        "partial": list(range(100)),
        "one_chunk": list(range(256)),
        "random_1000": [rng.randrange(0, 2**32) for _ in range(1000)],
        "extremes": [0, 2**32 - 1] * 256,
    }
    for chunk_size in (256, 16):
        hasher = TokenHasher(chunk_size=chunk_size, hash_algorithm="blake3")
        for name, tokens in token_lists.items():
            hashes = hasher.compute_chunk_hashes(tokens)
            ranks = {}
            for ws, wid in ((1, None), (2, None), (4, 3), (8, None)):
                k = key(tokens, worker_id=wid, world_size=ws, end=0, model="m", salt="s")
                ranks[f"{ws}/{wid}"] = [ok.kv_rank for ok in ipc_key_to_object_keys(k, hashes[:1], [0])[0]]
            hasher_cases.append({
                "name": name, "chunk_size": chunk_size, "token_ids": tokens,
                "none_hash": hasher.none_hash.hex(),
                "hashes": [h.hex() for h in hashes],
                "hashes_from_256": [h.hex() for h in hasher.compute_chunk_hashes(tokens, start=256)],
                "kv_ranks": ranks,
            })

    return [("requests", requests), ("replies", replies), ("hashes", hasher_cases),
            ("keys", key_cases())]


if __name__ == "__main__":
    main()
