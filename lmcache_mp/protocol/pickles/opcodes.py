"""The protocol-4 opcode writer: plain values in, the bytes ``pickle.dumps`` writes out.

It mirrors CPython's C pickler (Modules/_pickle.c) at protocol 4 for the value kinds of
``Value``: the output is byte-identical to what CPython 3.11's ``pickle.dumps(obj)``
writes for the real wrapper class (checked against fixtures recorded in the oracle venv,
see ``tools/gen_pickle_fixtures.py``), which keeps the wire frames comparable byte for
byte with LMCache's own client. The shape of every wrapper pickle is::

    PROTO 4, FRAME <u64 length of the rest>,
    <module> MEMOIZE <class> MEMOIZE STACK_GLOBAL MEMOIZE,   # the class
    EMPTY_TUPLE NEWOBJ MEMOIZE,                               # object.__reduce_ex__(4)
    EMPTY_DICT MEMOIZE MARK <key value>... SETITEMS,          # instance __dict__
    BUILD STOP

Only opcodes that build plain data plus exactly two STACK_GLOBALs (the wrapper class,
fixed by the template, and ``torch.<dtype>`` from a fixed list) are ever written, and
every value is validated and normalised to a plain builtin before it is written
(:mod:`.fields`), so nothing a caller passes can add opcodes or name another global.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from ...errors import InvalidArgument

__all__ = ["Global", "Value", "wrapper_pickle"]

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
class Global:
    """A ``module.name`` global, written with STACK_GLOBAL."""

    module: str
    name: str


#: What the writer accepts: plain builtins (already validated) and globals.
Value: TypeAlias = "None | bool | int | str | bytes | Global | tuple[Value, ...]"


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


def _write(out: bytearray, v: Value) -> None:
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
    elif isinstance(v, Global):
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


def _write_dict(out: bytearray, items: Sequence[tuple[str, Value]]) -> None:
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


def wrapper_pickle(module: str, qualname: str, items: Sequence[tuple[str, Value]]) -> bytes:
    """The protocol-4 pickle of an instance of ``module.qualname`` whose ``__dict__`` is
    ``items`` (validated values, in order): the shape in this module's docstring, one
    frame."""
    body = bytearray()
    _write(body, Global(module, qualname))
    body += _EMPTY_TUPLE + _NEWOBJ + _MEMOIZE
    _write_dict(body, items)
    body += _BUILD + _STOP
    # Everything we emit is one frame (< 64 KiB; CPython only frames payloads of >= 4
    # bytes and splits at 64 KiB). The frame length covers all that follows, STOP included.
    assert 4 <= len(body) < _FRAME_SIZE_TARGET
    return _PROTO + b"\x04" + _FRAME + struct.pack("<Q", len(body)) + bytes(body)
