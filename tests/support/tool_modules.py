"""The repository's tools/ scripts (not a package), loaded as modules for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str, module_name: str | None = None) -> ModuleType:
    """``tools/<name>.py`` as a module (named ``module_name``, default ``name``)."""
    spec = importlib.util.spec_from_file_location(module_name or name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there while made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module
