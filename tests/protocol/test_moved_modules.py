"""Modules that moved in issue 21 and stay importable by their old path: each old
module re-exports every public name of the new one (the very same objects), and says
where it went."""

from __future__ import annotations

import importlib

import pytest

MOVED = {
    "lmcache_mp.hashing": "lmcache_mp.protocol.hashing",
    "lmcache_mp.pickle_emitter": "lmcache_mp.protocol.pickles.emitter",
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_path_reexports_the_new_module(old: str, new: str) -> None:
    shim, module = importlib.import_module(old), importlib.import_module(new)
    assert sorted(shim.__all__) == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(shim, name) is getattr(module, name), name
    assert shim.__doc__ is not None and f"Moved to :mod:`{new}`" in shim.__doc__
