#!/usr/bin/env python3
"""Unpickle hand-written wrapper pickles with the real LMCache and check them (oracle venv).

    <oracle venv>/bin/python tools/oracle_unpickle_check.py < cases.json

stdin: a JSON list of ``{"template": name, "pickle": hex, "fields": {...}}`` where
``fields`` uses the fixture encoding of tools/gen_pickle_fixtures.py (bytes as
``{"$bytes": hex}``, tuples as lists, dtype as its torch name; ``none``/``const_str``
fields may be left out). Each pickle is ``pickle.loads``-ed with LMCache installed, as the
server does, and must give exactly the template's class with exactly the expected
``__dict__`` (same keys in the same order, same value types and values); pickling the
restored object again must give back the same bytes.

stdout: one JSON object ``{"ok", "count", "failed", "results": [...]}``. Exit status 0
only when every case matches. Unpickling happens only here, in the oracle venv, never in
lmcache_mp.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent.parent / "pickle_templates"


def untag(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"$bytes"}:
        return bytes.fromhex(value["$bytes"])
    if isinstance(value, list):
        return tuple(untag(v) for v in value)
    return value


def same(actual: Any, expected: Any) -> bool:
    """Equal and of exactly the same types all the way down (True != 1 here)."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, tuple):
        return len(actual) == len(expected) and all(map(same, actual, expected))
    return bool(actual == expected)


def check(case: dict[str, Any], torch: Any) -> dict[str, Any]:
    errors: list[str] = []
    name = case["template"]
    if not isinstance(name, str) or not name.isidentifier():
        return {"template": name, "ok": False, "errors": ["bad template name"]}
    template = json.loads((TEMPLATES / f"{name}.json").read_text())
    data = bytes.fromhex(case["pickle"])
    given = case.get("fields", {})
    obj = pickle.loads(data)
    cls = type(obj)
    if (cls.__module__, cls.__qualname__) != (template["module"], template["class"]):
        errors.append(f"class {cls.__module__}.{cls.__qualname__}, expected "
                      f"{template['module']}.{template['class']}")
    state = getattr(obj, "__dict__", {})
    names = [f["name"] for f in template["fields"]]
    if list(state) != names:
        errors.append(f"__dict__ keys {list(state)}, expected {names}")
    for spec in template["fields"]:
        key, kind = spec["name"], spec["type"]
        if key not in state:
            continue
        actual = state[key]
        if kind == "none":
            expected: Any = None
        elif kind == "const_str":
            expected = spec["value"]
        elif key not in given:
            errors.append(f"{key}: no expected value given")
            continue
        else:
            expected = untag(given[key])
        if kind == "torch_dtype":
            name_ = expected[len("torch."):] if expected.startswith("torch.") else expected
            ok = isinstance(actual, torch.dtype) and str(actual) == "torch." + name_
        else:
            ok = same(actual, expected)
        if not ok:
            errors.append(f"{key}: got {actual!r}, expected {expected!r}")
    repickled = pickle.dumps(obj)
    if repickled != data:
        errors.append(f"pickle.dumps of the restored object differs: {repickled.hex()}")
    return {"template": name, "ok": not errors, "errors": errors}


def main() -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # LMCache/torch may log on import; keep stdout pure JSON
    try:
        import torch  # noqa: F401  (needed for the dtype comparison)

        cases = json.load(sys.stdin)
        results = []
        for i, case in enumerate(cases):
            try:
                result = check(case, torch)
            except Exception as exc:  # a case that does not even load is a failure
                result = {"template": case.get("template"), "ok": False,
                          "errors": [f"{type(exc).__name__}: {exc}"]}
            result["index"] = i
            results.append(result)
    finally:
        sys.stdout = real_stdout
    failed = sum(not r["ok"] for r in results)
    print(json.dumps({"ok": failed == 0 and bool(results), "count": len(results),
                      "failed": failed, "results": results}))
    return 0 if failed == 0 and results else 1


if __name__ == "__main__":
    sys.exit(main())
