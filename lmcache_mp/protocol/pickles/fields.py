"""The field types of a wrapper template: one validator per type, and the dtype names.

Every check first turns the caller's value into an exact builtin (a str/int/bytes
subclass could override encode/__index__/__bytes__), then validates that copy, and the
writer only ever sees the copy: what was checked is what gets written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import InvalidArgument
from .opcodes import Global, Value

#: Canonical ``torch.<name>`` dtype names we write. These are the names
#: ``torch.dtype.__reduce__`` returns, i.e. what ``pickle.dumps`` writes for the dtype.
#: The server's torch must have the attribute: float8_e8m0fnu needs torch >= 2.7,
#: float4_e2m1fn_x2 >= 2.8, uint16/32/64 >= 2.3.
TORCH_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
    }
)

# torch aliases are the very same dtype objects, and pickle writes the canonical name; we
# do not silently rewrite them (a caller comparing fields would be surprised) but say
# which name to use instead.
_DTYPE_ALIASES = {
    "half": "float16", "float": "float32", "double": "float64",
    "short": "int16", "int": "int32", "long": "int64",
}

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_DIMS = 8  # torch allows more, but no KV cache layout has more; keeps blobs small
# shm_open(3) names: one leading '/', then a portable filename (NAME_MAX 255 on Linux).
_SHM_NAME_RE = re.compile(r"/[A-Za-z0-9_.-]{1,250}")
# torch renders device UUIDs lower-case, hyphenated, without the 'GPU-' prefix nvidia-smi
# shows; the server compares the string verbatim with its own devices'.
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_CUDA_IPC_HANDLE_LEN = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)

#: The 8-tuple of ``torch.UntypedStorage._share_cuda_()``.
CudaStorageHandle = tuple[int, bytes, int, int, bytes, int, bytes, bool]


@dataclass(frozen=True)
class FieldSpec:
    """One entry of a wrapper's ``__dict__``, in pickle (insertion) order."""

    name: str
    type: str
    description: str
    value: str | None = None  # the constant of a ``const_str`` field
    same_length_as: str | None = None  # another tuple field this one must match


def _fail(where: str, problem: str, fix: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {problem}; {fix}")


def _as_int(where: str, value: object, lo: int, hi: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"expected an int, got {type(value).__name__}", fix)
    v = int.__int__(value)
    if not lo <= v <= hi:
        raise _fail(where, f"{v} is outside [{lo}, {hi}]", fix)
    return v


def _as_str(where: str, value: object, fix: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"expected a str, got {type(value).__name__}", fix)
    return str.__str__(value)


def _as_bytes(where: str, value: object, lo: int, hi: int, fix: str) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise _fail(where, f"expected bytes, got {type(value).__name__}", fix)
    try:
        b = memoryview(value).tobytes()
    except (TypeError, ValueError) as exc:
        raise _fail(where, f"unreadable buffer ({exc})", fix) from None
    if not lo <= len(b) <= hi:
        want = f"exactly {lo}" if lo == hi else f"{lo} to {hi}"
        raise _fail(where, f"{len(b)} bytes, expected {want}", fix)
    return b


def _as_int_tuple(where: str, value: object, lo: int, hi: int, fix: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise _fail(where, f"expected a tuple of ints, got {type(value).__name__}", fix)
    items = tuple(value)  # one snapshot: validated and written from the same object
    if len(items) > _MAX_DIMS:
        raise _fail(where, f"{len(items)} dims, at most {_MAX_DIMS} are supported", fix)
    return tuple(_as_int(f"{where}[{i}]", x, lo, hi, fix) for i, x in enumerate(items))


def _check_shm_name(where: str, value: object, spec: FieldSpec) -> Value:
    fix = (
        "pass a POSIX shm name such as '/lmcache_kv_<pid>_<n>': "
        "a leading '/' then 1-250 of [A-Za-z0-9_.-]"
    )
    name = _as_str(where, value, fix)
    # fullmatch, not '$': '$' also matches before a trailing newline.
    if _SHM_NAME_RE.fullmatch(name) is None or name in ("/.", "/.."):
        raise _fail(where, f"invalid shm name {name!r}", fix)
    return name


def _check_nbytes(where: str, value: object, spec: FieldSpec) -> Value:
    return _as_int(where, value, 0, _INT64_MAX, "pass the byte count as a non-negative int64")


def _check_storage_offset(where: str, value: object, spec: FieldSpec) -> Value:
    return _as_int(where, value, 0, _INT64_MAX, "pass the offset in elements as a non-negative int")


def _check_none(where: str, value: object, spec: FieldSpec) -> Value:
    if value is not None:
        raise _fail(where, f"must be None, got {value!r}", "omit it or pass None")
    return None


def _check_const_str(where: str, value: object, spec: FieldSpec) -> Value:
    assert spec.value is not None  # guaranteed by the template loader
    if value is None:
        return spec.value
    if _as_str(where, value, f"omit it or pass {spec.value!r}") != spec.value:
        raise _fail(where, f"must be {spec.value!r}, got {value!r}", "omit it")
    return spec.value


def _check_torch_dtype(where: str, value: object, spec: FieldSpec) -> Value:
    fix = f"pass one of {', '.join(sorted(TORCH_DTYPES))} (optionally prefixed 'torch.')"
    name = _as_str(where, value, fix)
    if name.startswith("torch."):  # str(tensor.dtype) gives 'torch.float16'
        name = name[len("torch."):]
    if name in _DTYPE_ALIASES:
        canonical = _DTYPE_ALIASES[name]
        raise _fail(where, f"{value!r} is an alias", f"pass {canonical!r}, the name pickle writes")
    if name not in TORCH_DTYPES:
        raise _fail(where, f"unsupported dtype {value!r}", fix)
    return Global("torch", name)


def _check_shape(where: str, value: object, spec: FieldSpec) -> Value:
    return _as_int_tuple(where, value, 0, _INT64_MAX, "pass tuple(tensor.shape): non-negative ints")


def _check_stride(where: str, value: object, spec: FieldSpec) -> Value:
    return _as_int_tuple(
        where, value, _INT64_MIN, _INT64_MAX, "pass tuple(tensor.stride()): int64s in elements"
    )


def _check_cuda_uuid(where: str, value: object, spec: FieldSpec) -> Value:
    fix = (
        "pass str(torch.cuda.get_device_properties(i).uuid): lower-case 8-4-4-4-12 hex "
        "without a 'GPU-' prefix (for nvidia-smi's 'GPU-…' form use s[4:].lower())"
    )
    uuid = _as_str(where, value, fix)
    if _UUID_RE.fullmatch(uuid) is None:
        raise _fail(where, f"invalid device UUID {uuid!r}", fix)
    return uuid


def _check_cuda_ipc_mem_handle(where: str, value: object, spec: FieldSpec) -> Value:
    return _as_bytes(
        where, value, _CUDA_IPC_HANDLE_LEN, _CUDA_IPC_HANDLE_LEN,
        "pass bytes(cudaIpcGetMemHandle(base_ptr).reserved), the 64-byte cudaIpcMemHandle_t",
    )


def _check_cuda_storage_handle(where: str, value: object, spec: FieldSpec) -> Value:
    fix = (
        "pass the 8-tuple of UntypedStorage._share_cuda_(): (device index, storage handle "
        "bytes, storage size, storage byte offset, ref-counter name bytes, ref-counter "
        "offset, 64-byte event handle, event_sync_required bool)"
    )
    if not isinstance(value, (tuple, list)):
        raise _fail(where, f"expected a tuple, got {type(value).__name__}", fix)
    items = tuple(value)
    if len(items) != 8:
        raise _fail(where, f"{len(items)} items, expected 8", fix)
    # Byte strings of length >= 2 (and the single optional 1-byte one) are always distinct
    # objects in real pickles; two equal 1-byte or empty bytes could be CPython singletons
    # and pickle would then write BINGET, so the lengths below rule that out.
    sync = items[7]
    if not isinstance(sync, bool):
        raise _fail(f"{where}[7]", f"expected a bool, got {type(sync).__name__}", fix)
    return (
        _as_int(f"{where}[0]", items[0], 0, 2**31 - 1, fix),
        _as_bytes(f"{where}[1]", items[1], 64, 1024, fix),
        _as_int(f"{where}[2]", items[2], 0, _INT64_MAX, fix),
        _as_int(f"{where}[3]", items[3], 0, _INT64_MAX, fix),
        _as_bytes(f"{where}[4]", items[4], 1, 255, fix),
        _as_int(f"{where}[5]", items[5], 0, _INT64_MAX, fix),
        _as_bytes(f"{where}[6]", items[6], _CUDA_IPC_HANDLE_LEN, _CUDA_IPC_HANDLE_LEN, fix),
        bool(sync),
    )


#: Each field type of a template -> its check: ``(where, value, spec)`` -> the value to write.
FIELD_TYPES = {
    "shm_name": _check_shm_name,
    "nbytes": _check_nbytes,
    "storage_offset": _check_storage_offset,
    "none": _check_none,
    "const_str": _check_const_str,
    "torch_dtype": _check_torch_dtype,
    "shape": _check_shape,
    "stride": _check_stride,
    "cuda_uuid": _check_cuda_uuid,
    "cuda_ipc_mem_handle": _check_cuda_ipc_mem_handle,
    "cuda_storage_handle": _check_cuda_storage_handle,
}
#: Field types a caller may leave out (their value is fixed).
OPTIONAL_TYPES = frozenset({"none", "const_str"})
