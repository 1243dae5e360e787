"""The ``lmcache-mp`` command line, above the session layer: :mod:`.main` (the commands
and :func:`main`, the ``lmcache-mp`` entry point; ``python -m lmcache_mp.cli`` runs it
too), :mod:`.doctor` and :mod:`.host_facts` (``lmcache-mp doctor``), :mod:`.bench` and
:mod:`.bench_report` (``lmcache-mp bench``).

``lmcache_mp.cli.main`` is the function here; its module is
``sys.modules["lmcache_mp.cli.main"]`` (``from lmcache_mp.cli.main import ...`` reads
from it as usual).
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
