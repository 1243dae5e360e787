"""``python -m lmcache_mp.cli``: the ``lmcache-mp`` command."""

from __future__ import annotations

import sys

from .commands import main

sys.exit(main())
