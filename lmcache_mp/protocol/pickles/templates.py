"""The annotated wrapper-class templates (``pickle_templates/*.json``) and their loader.

A template names the LMCache class a wrapper pickle builds and its instance ``__dict__``
in pickle order, each field with a type from :mod:`.fields`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ...errors import InvalidArgument, LMCacheMPError
from .fields import FIELD_TYPES, FieldSpec

#: Templates shipped in ``pickle_templates/`` (installed as ``lmcache_mp.pickle_templates``;
#: file stem = name). A fixed list,
#: so a template name from a caller can never become a path.
TEMPLATE_NAMES: tuple[str, ...] = (
    "v0_5_3_cpu_shm", "v0_5_3_raw_cuda", "v0_5_3_cuda_ipc", "v0_5_5_raw_cuda",
)

_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Template:
    """An annotated wrapper-class template (see ``pickle_templates/README.md``)."""

    name: str
    module: str
    qualname: str
    description: str
    lmcache_versions: tuple[str, ...]
    fields: tuple[FieldSpec, ...]


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
        # lmcache_mp/protocol/pickles/templates.py: the checkout is three folders up
        checkout = Path(__file__).resolve().parents[3] / "pickle_templates"
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
        if ftype not in FIELD_TYPES:
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
