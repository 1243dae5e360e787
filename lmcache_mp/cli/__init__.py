"""The ``lmcache-mp`` command line, above the session layer: :mod:`.commands` (the
commands and :func:`main`, the ``lmcache-mp`` entry point; ``python -m lmcache_mp.cli``
runs it too), :mod:`.doctor` and :mod:`.host_facts` (``lmcache-mp doctor``),
:mod:`.bench` and :mod:`.bench_report` (``lmcache-mp bench``)."""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
