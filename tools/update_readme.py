#!/usr/bin/env python3
"""Rewrite README.md's compatibility table from the protocol profiles."""

from __future__ import annotations

import re
from pathlib import Path

from lmcache_mp.protocol.compat import compatibility_table

README = Path(__file__).resolve().parent.parent / "README.md"
MARKERS = re.compile(r"(<!-- compat:start -->\n).*?(\n<!-- compat:end -->)", re.S)


def main() -> None:
    text = README.read_text()
    new = MARKERS.sub(lambda m: m.group(1) + compatibility_table() + m.group(2), text)
    README.write_text(new)


if __name__ == "__main__":
    main()
