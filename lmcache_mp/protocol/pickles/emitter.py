"""Write LMCache's KV-cache IPC wrapper pickles by hand, byte-identical to ``pickle.dumps``.

REGISTER_KV_CACHE carries one ``pickle.dumps(wrapper)`` blob per layer (msgpack ext
type 1), and the server ``pickle.loads`` it. lmcache_mp must not depend on ``lmcache``
(or torch) and never unpickles anything, so it writes those protocol-4 opcode streams
itself from an annotated template per wrapper class (``pickle_templates/*.json``).

This is the public module: :func:`emit` and one helper per wrapper class. The parts live
in :mod:`lmcache_mp.protocol.pickles`: the template loader (``templates``), the field validators
(``fields``) and the opcode writer (``opcodes``, which also describes the shape of every
wrapper pickle). Every value is validated and normalised to a plain builtin before it is
written, so nothing a caller passes can add opcodes or name another global.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...errors import InvalidArgument
from .fields import FIELD_TYPES, OPTIONAL_TYPES, TORCH_DTYPES, CudaStorageHandle, FieldSpec
from .opcodes import Value, wrapper_pickle
from .templates import TEMPLATE_NAMES, Template, load_template

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


def _validate(template: Template, fields: Mapping[str, object]) -> list[tuple[str, Value]]:
    if not isinstance(fields, Mapping):
        raise InvalidArgument(f"{template.name}: fields must be a mapping of field name to value")
    known = {f.name for f in template.fields}
    unknown = sorted(str(k) for k in fields if k not in known)
    if unknown:
        raise InvalidArgument(
            f"{template.name}: unknown field(s) {', '.join(unknown)}; "
            f"the fields are {', '.join(f.name for f in template.fields)}"
        )
    values: dict[str, Value] = {}
    for spec in template.fields:
        where = f"{template.name}.{spec.name}"
        if spec.name not in fields and spec.type not in OPTIONAL_TYPES:
            raise InvalidArgument(f"{where}: missing; pass it (see the template's description)")
        value = FIELD_TYPES[spec.type](where, fields.get(spec.name), spec)
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
    return wrapper_pickle(template.module, template.qualname, _validate(template, fields))


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
