"""Write LMCache's KV-cache IPC wrapper pickles by hand, byte-identical to ``pickle.dumps``.

REGISTER_KV_CACHE carries one ``pickle.dumps(wrapper)`` blob per layer (msgpack ext
type 1), and the server ``pickle.loads`` it. lmcache_mp must not depend on ``lmcache``
(or torch) and never unpickles anything, so it writes those protocol-4 opcode streams
itself from an annotated template per wrapper class (``pickle_templates/*.json``).

The output is byte-identical to what CPython 3.11's ``pickle.dumps(obj)`` writes for the
real class (checked against fixtures recorded in the oracle venv, see
``tools/gen_pickle_fixtures.py``), which keeps the wire frames comparable byte for byte
with LMCache's own client. The shape of every wrapper pickle is::

    PROTO 4, FRAME <u64 length of the rest>,
    <module> MEMOIZE <class> MEMOIZE STACK_GLOBAL MEMOIZE,   # the class
    EMPTY_TUPLE NEWOBJ MEMOIZE,                               # object.__reduce_ex__(4)
    EMPTY_DICT MEMOIZE MARK <key value>... SETITEMS,          # instance __dict__
    BUILD STOP

Only opcodes that build plain data plus exactly two STACK_GLOBALs (the wrapper class,
fixed by the template, and ``torch.<dtype>`` from a fixed list) are ever written, and
every value is validated and normalised to a plain builtin before it is written, so
nothing a caller passes can add opcodes or name another global.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeAlias

from .errors import InvalidArgument, LMCacheMPError

__all__ = [
    "TEMPLATE_NAMES",
    "TORCH_DTYPES",
    "FieldSpec",
    "Template",
    "CudaStorageHandle",
    "load_template",
    "emit",
    "emit_cpu_shm_wrapper",
    "emit_raw_cuda_wrapper",
    "emit_cuda_ipc_wrapper",
]

#: Templates shipped in ``pickle_templates/`` (installed as ``lmcache_mp.pickle_templates``;
#: file stem = name). A fixed list,
#: so a template name from a caller can never become a path.
TEMPLATE_NAMES: tuple[str, ...] = (
    "v0_5_3_cpu_shm", "v0_5_3_raw_cuda", "v0_5_3_cuda_ipc", "v0_5_5_raw_cuda",
)

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
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CUDA_IPC_HANDLE_LEN = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)

# Protocol-4 opcodes (names as in pickletools / Lib/pickle.py).
_PROTO = b"\x80"
_FRAME = b"\x95"
_STOP = b"."
_MEMOIZE = b"\x94"
_SHORT_BINUNICODE = b"\x8c"
_BINUNICODE = b"X"
_SHORT_BINBYTES = b"C"
_BINBYTES = b"B"
_STACK_GLOBAL = b"\x93"
_EMPTY_TUPLE = b")"
_NEWOBJ = b"\x81"
_EMPTY_DICT = b"}"
_MARK = b"("
_SETITEM = b"s"
_SETITEMS = b"u"
_BUILD = b"b"
_NONE = b"N"
_NEWTRUE = b"\x88"
_NEWFALSE = b"\x89"
_BININT1 = b"K"
_BININT2 = b"M"
_BININT = b"J"
_LONG1 = b"\x8a"
_TUPLE = b"t"
_TUPLE_N = (b"", b"\x85", b"\x86", b"\x87")  # TUPLE1, TUPLE2, TUPLE3
# CPython's pickler starts a new frame (and writes big str/bytes outside frames) at
# 64 KiB; everything we emit is far below, so each pickle is exactly one frame.
_FRAME_SIZE_TARGET = 64 * 1024
_SETITEMS_BATCH = 1000  # pickle's _BATCHSIZE; our dicts have at most 8 items


@dataclass(frozen=True)
class _Global:
    """A ``module.name`` global, written with STACK_GLOBAL."""

    module: str
    name: str


# What the writer accepts: plain builtins (already validated) and globals.
_Value: TypeAlias = "None | bool | int | str | bytes | _Global | tuple[_Value, ...]"

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


@dataclass(frozen=True)
class Template:
    """An annotated wrapper-class template (see ``pickle_templates/README.md``)."""

    name: str
    module: str
    qualname: str
    description: str
    lmcache_versions: tuple[str, ...]
    fields: tuple[FieldSpec, ...]


# ---------------------------------------------------------------------------------------
# Value normalisation and validation.
#
# Every check first turns the caller's value into an exact builtin (a str/int/bytes
# subclass could override encode/__index__/__bytes__), then validates that copy, and the
# writer only ever sees the copy: what was checked is what gets written.


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


def _check_shm_name(where: str, value: object, spec: FieldSpec) -> _Value:
    fix = (
        "pass a POSIX shm name such as '/lmcache_kv_<pid>_<n>': "
        "a leading '/' then 1-250 of [A-Za-z0-9_.-]"
    )
    name = _as_str(where, value, fix)
    # fullmatch, not '$': '$' also matches before a trailing newline.
    if _SHM_NAME_RE.fullmatch(name) is None or name in ("/.", "/.."):
        raise _fail(where, f"invalid shm name {name!r}", fix)
    return name


def _check_nbytes(where: str, value: object, spec: FieldSpec) -> _Value:
    return _as_int(where, value, 0, _INT64_MAX, "pass the byte count as a non-negative int64")


def _check_storage_offset(where: str, value: object, spec: FieldSpec) -> _Value:
    return _as_int(where, value, 0, _INT64_MAX, "pass the offset in elements as a non-negative int")


def _check_none(where: str, value: object, spec: FieldSpec) -> _Value:
    if value is not None:
        raise _fail(where, f"must be None, got {value!r}", "omit it or pass None")
    return None


def _check_const_str(where: str, value: object, spec: FieldSpec) -> _Value:
    assert spec.value is not None  # guaranteed by the template loader
    if value is None:
        return spec.value
    if _as_str(where, value, f"omit it or pass {spec.value!r}") != spec.value:
        raise _fail(where, f"must be {spec.value!r}, got {value!r}", "omit it")
    return spec.value


def _check_torch_dtype(where: str, value: object, spec: FieldSpec) -> _Value:
    fix = f"pass one of {', '.join(sorted(TORCH_DTYPES))} (optionally prefixed 'torch.')"
    name = _as_str(where, value, fix)
    if name.startswith("torch."):  # str(tensor.dtype) gives 'torch.float16'
        name = name[len("torch."):]
    if name in _DTYPE_ALIASES:
        canonical = _DTYPE_ALIASES[name]
        raise _fail(where, f"{value!r} is an alias", f"pass {canonical!r}, the name pickle writes")
    if name not in TORCH_DTYPES:
        raise _fail(where, f"unsupported dtype {value!r}", fix)
    return _Global("torch", name)


def _check_shape(where: str, value: object, spec: FieldSpec) -> _Value:
    return _as_int_tuple(where, value, 0, _INT64_MAX, "pass tuple(tensor.shape): non-negative ints")


def _check_stride(where: str, value: object, spec: FieldSpec) -> _Value:
    return _as_int_tuple(
        where, value, _INT64_MIN, _INT64_MAX, "pass tuple(tensor.stride()): int64s in elements"
    )


def _check_cuda_uuid(where: str, value: object, spec: FieldSpec) -> _Value:
    fix = (
        "pass str(torch.cuda.get_device_properties(i).uuid): lower-case 8-4-4-4-12 hex "
        "without a 'GPU-' prefix (for nvidia-smi's 'GPU-…' form use s[4:].lower())"
    )
    uuid = _as_str(where, value, fix)
    if _UUID_RE.fullmatch(uuid) is None:
        raise _fail(where, f"invalid device UUID {uuid!r}", fix)
    return uuid


def _check_cuda_ipc_mem_handle(where: str, value: object, spec: FieldSpec) -> _Value:
    return _as_bytes(
        where, value, _CUDA_IPC_HANDLE_LEN, _CUDA_IPC_HANDLE_LEN,
        "pass bytes(cudaIpcGetMemHandle(base_ptr).reserved), the 64-byte cudaIpcMemHandle_t",
    )


def _check_cuda_storage_handle(where: str, value: object, spec: FieldSpec) -> _Value:
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


_FIELD_TYPES = {
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
# Field types a caller may leave out (their value is fixed).
_OPTIONAL_TYPES = frozenset({"none", "const_str"})


# ---------------------------------------------------------------------------------------
# Templates


def _template_error(name: str, problem: str) -> RuntimeError:
    return RuntimeError(
        f"pickle template {name!r} is malformed ({problem}); the lmcache_mp installation "
        "is damaged: reinstall it"
    )


def _template_text(name: str) -> str:
    """The JSON of template ``name``: from the installed package
    ``lmcache_mp.pickle_templates``, else, when lmcache_mp runs from a source checkout
    put on ``sys.path`` (the GPU check does that on the device, where nothing is
    installed), from the checkout's top-level ``pickle_templates/`` folder."""
    try:
        ref = resources.files("lmcache_mp.pickle_templates") / f"{name}.json"
        return ref.read_text(encoding="utf-8")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent / "pickle_templates"
        path = checkout / f"{name}.json"
        if not path.is_file():
            raise LMCacheMPError(
                f"pickle template {name}.json is missing: neither the package "
                f"lmcache_mp.pickle_templates nor {checkout} exists; reinstall lmcache-mp"
            ) from None
        return path.read_text(encoding="utf-8")


@functools.cache
def load_template(name: str) -> Template:
    """The parsed template ``name`` (one of :data:`TEMPLATE_NAMES`)."""
    if name not in TEMPLATE_NAMES:
        raise InvalidArgument(
            f"unknown pickle template {name!r}; use one of {', '.join(TEMPLATE_NAMES)}"
        )
    raw: Any = json.loads(_template_text(name))
    if not isinstance(raw, dict) or raw.get("format") != 1 or raw.get("name") != name:
        raise _template_error(name, "expected a format-1 object with a matching name")
    module, qualname = raw.get("module"), raw.get("class")
    # Only LMCache classes: a template can never make the server import anything else.
    if not (
        isinstance(module, str)
        and module.startswith("lmcache.")
        and all(_IDENT_RE.fullmatch(p) for p in module.split("."))
        and isinstance(qualname, str)
        and _IDENT_RE.fullmatch(qualname)
    ):
        raise _template_error(name, "bad module or class")
    fields: list[FieldSpec] = []
    for entry in raw.get("fields", ()):
        if not isinstance(entry, dict):
            raise _template_error(name, "a field is not an object")
        fname, ftype = entry.get("name"), entry.get("type")
        if not (isinstance(fname, str) and _IDENT_RE.fullmatch(fname)):
            raise _template_error(name, f"bad field name {fname!r}")
        if ftype not in _FIELD_TYPES:
            raise _template_error(name, f"unknown field type {ftype!r}")
        const, same = entry.get("value"), entry.get("same_length_as")
        if (ftype == "const_str") != isinstance(const, str):
            raise _template_error(name, f"field {fname}: 'value' goes with const_str only")
        if same is not None and same not in {f.name for f in fields}:
            raise _template_error(name, f"field {fname}: same_length_as an earlier field")
        fields.append(
            FieldSpec(fname, ftype, str(entry.get("description", "")), const, same)
        )
    if not fields or len({f.name for f in fields}) != len(fields):
        raise _template_error(name, "no fields, or duplicate field names")
    versions = raw.get("lmcache_versions", [])
    return Template(
        name=name,
        module=module,
        qualname=qualname,
        description=str(raw.get("description", "")),
        lmcache_versions=tuple(str(v) for v in versions),
        fields=tuple(fields),
    )


# ---------------------------------------------------------------------------------------
# The opcode writer: mirrors CPython's C pickler (Modules/_pickle.c) at protocol 4 for
# the value kinds above.


def _write_str(out: bytearray, s: str) -> None:
    data = s.encode("utf-8", "surrogatepass")  # what pickle uses for str
    if len(data) < 256:
        out += _SHORT_BINUNICODE + bytes((len(data),))
    elif len(data) <= 0xFFFFFFFF:
        out += _BINUNICODE + struct.pack("<I", len(data))
    else:  # pragma: no cover - validation caps every string far below
        raise InvalidArgument("string too long to pickle here")
    out += data
    out += _MEMOIZE


def _write_bytes(out: bytearray, b: bytes) -> None:
    if len(b) < 256:
        out += _SHORT_BINBYTES + bytes((len(b),))
    elif len(b) <= 0xFFFFFFFF:
        out += _BINBYTES + struct.pack("<I", len(b))
    else:  # pragma: no cover - validation caps every byte string far below
        raise InvalidArgument("bytes too long to pickle here")
    out += b
    out += _MEMOIZE


def _write_int(out: bytearray, v: int) -> None:
    # pickle picks the shortest of BININT1 (u8), BININT2 (u16), BININT (i32), LONG1.
    if 0 <= v <= 0xFF:
        out += _BININT1 + bytes((v,))
    elif 0 <= v <= 0xFFFF:
        out += _BININT2 + struct.pack("<H", v)
    elif -(2**31) <= v <= 2**31 - 1:
        out += _BININT + struct.pack("<i", v)
    else:
        # LONG1: minimal little-endian two's complement, exactly as pickle.encode_long:
        # (bit_length // 8) + 1 bytes, minus a redundant 0xff sign byte for negatives.
        data = v.to_bytes((v.bit_length() >> 3) + 1, "little", signed=True)
        if v < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
            data = data[:-1]
        out += _LONG1 + bytes((len(data),)) + data  # int64 needs at most 9 bytes


def _write(out: bytearray, v: _Value) -> None:
    # No BINGET ever: in real wrappers every str/bytes/tuple is a distinct object (shape
    # and stride come from tuple(...)), so pickle's identity memo never hits; the empty
    # tuple is a singleton but pickle does not memoize it.
    if v is None:
        out += _NONE
    elif isinstance(v, bool):  # before int: bool is an int subclass
        out += _NEWTRUE if v else _NEWFALSE
    elif isinstance(v, int):
        _write_int(out, v)
    elif isinstance(v, str):
        _write_str(out, v)
    elif isinstance(v, bytes):
        _write_bytes(out, v)
    elif isinstance(v, _Global):
        _write_str(out, v.module)
        _write_str(out, v.name)
        out += _STACK_GLOBAL + _MEMOIZE
    else:
        if not v:
            out += _EMPTY_TUPLE
            return
        if len(v) <= 3:
            for item in v:
                _write(out, item)
            out += _TUPLE_N[len(v)]
        else:
            out += _MARK
            for item in v:
                _write(out, item)
            out += _TUPLE
        out += _MEMOIZE


def _write_dict(out: bytearray, items: Sequence[tuple[str, _Value]]) -> None:
    out += _EMPTY_DICT + _MEMOIZE
    for start in range(0, len(items), _SETITEMS_BATCH):
        batch = items[start : start + _SETITEMS_BATCH]
        if len(batch) == 1:
            _write_str(out, batch[0][0])
            _write(out, batch[0][1])
            out += _SETITEM
        else:
            out += _MARK
            for key, value in batch:
                _write_str(out, key)
                _write(out, value)
            out += _SETITEMS


def _validate(template: Template, fields: Mapping[str, object]) -> list[tuple[str, _Value]]:
    if not isinstance(fields, Mapping):
        raise InvalidArgument(f"{template.name}: fields must be a mapping of field name to value")
    known = {f.name for f in template.fields}
    unknown = sorted(str(k) for k in fields if k not in known)
    if unknown:
        raise InvalidArgument(
            f"{template.name}: unknown field(s) {', '.join(unknown)}; "
            f"the fields are {', '.join(f.name for f in template.fields)}"
        )
    values: dict[str, _Value] = {}
    for spec in template.fields:
        where = f"{template.name}.{spec.name}"
        if spec.name not in fields and spec.type not in _OPTIONAL_TYPES:
            raise InvalidArgument(f"{where}: missing; pass it (see the template's description)")
        value = _FIELD_TYPES[spec.type](where, fields.get(spec.name), spec)
        if spec.same_length_as is not None:
            other = values[spec.same_length_as]
            assert isinstance(value, tuple) and isinstance(other, tuple)
            if len(value) != len(other):
                raise InvalidArgument(
                    f"{where}: {len(value)} entries but {spec.same_length_as} has "
                    f"{len(other)}; pass one value per dimension"
                )
        values[spec.name] = value
    return list(values.items())


def emit(template_name: str, fields: Mapping[str, object]) -> bytes:
    """``pickle.dumps`` of the wrapper ``template_name`` with ``__dict__`` = ``fields``.

    ``fields`` maps each template field name (the real ``__dict__`` key) to its value:
    str, int, ``None``, bytes, a tuple/list of ints, a dtype name such as ``"float16"``.
    Fields of type ``none`` / ``const_str`` may be left out. Raises
    :class:`~lmcache_mp.errors.InvalidArgument` for anything out of spec.
    """
    template = load_template(template_name)
    items = _validate(template, fields)
    body = bytearray()
    _write(body, _Global(template.module, template.qualname))
    body += _EMPTY_TUPLE + _NEWOBJ + _MEMOIZE
    _write_dict(body, items)
    body += _BUILD + _STOP
    # Everything we emit is one frame (< 64 KiB; CPython only frames payloads of >= 4
    # bytes and splits at 64 KiB). The frame length covers all that follows, STOP included.
    assert 4 <= len(body) < _FRAME_SIZE_TARGET
    return _PROTO + b"\x04" + _FRAME + struct.pack("<Q", len(body)) + bytes(body)


def emit_cpu_shm_wrapper(
    *,
    shm_name: str,
    nbytes: int,
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int],
    storage_offset: int = 0,
) -> bytes:
    """``pickle.dumps`` of an LMCache 0.5.3 ``CpuShmTensorWrapper``.

    ``shm_name`` is the POSIX shm segment (``/name``) the server maps, ``nbytes`` the
    bytes it maps (numel * element size), ``stride``/``storage_offset`` in elements.
    """
    return emit(
        "v0_5_3_cpu_shm",
        {
            "shm_name": shm_name,
            "nbytes": nbytes,
            "dtype": dtype,
            "shape": shape,
            "stride": stride,
            "storage_offset": storage_offset,
        },
    )


def emit_raw_cuda_wrapper(
    *,
    ipc_handle: bytes,
    nbytes: int,
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int],
    device_uuid: str,
    storage_offset: int = 0,
) -> bytes:
    """``pickle.dumps`` of an LMCache 0.5.3 ``RawCudaIPCWrapper``.

    ``ipc_handle`` is the 64-byte ``cudaIpcMemHandle_t`` of the allocation's base,
    ``nbytes`` the bytes the server maps from it, ``device_uuid`` the torch form
    (lower-case 8-4-4-4-12 hex). The server needs cupy for this wrapper.
    """
    return emit(
        "v0_5_3_raw_cuda",
        {
            "_ipc_handle_reserved": ipc_handle,
            "_nbytes": nbytes,
            "dtype": dtype,
            "shape": shape,
            "stride": stride,
            "storage_offset": storage_offset,
            "device_uuid": device_uuid,
        },
    )


def emit_cuda_ipc_wrapper(
    *,
    handle: Sequence[object],
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int],
    device_uuid: str,
    storage_offset: int = 0,
) -> bytes:
    """``pickle.dumps`` of an LMCache 0.5.3-0.5.5 ``CudaIPCWrapper`` (same class path
    and ``__dict__`` in each).

    ``handle`` is the :data:`CudaStorageHandle` 8-tuple of
    ``UntypedStorage._share_cuda_()``; ``device_uuid`` the torch form.
    """
    return emit(
        "v0_5_3_cuda_ipc",
        {
            "handle": handle,
            "dtype": dtype,
            "shape": shape,
            "stride": stride,
            "storage_offset": storage_offset,
            "device_uuid": device_uuid,
        },
    )
