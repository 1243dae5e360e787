"""README's compatibility table is generated from the profiles, not typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

from lmcache_mp.protocol import PROFILES, get_profile
from lmcache_mp.protocol.compat import compatibility_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_table_matches_the_profiles() -> None:
    m = re.search(r"<!-- compat:start -->\n(.*?)\n<!-- compat:end -->", README.read_text(), re.S)
    assert m, "README.md lost its compat markers"
    assert m.group(1) == compatibility_table(), "run `make readme`"


def test_every_release_maps_to_a_profile() -> None:
    assert set(PROFILES) == {"0.5.3", "0.5.5", "0.5.6", "0.5.7"}
    assert get_profile("0.5.4") is get_profile("0.5.3")
    assert get_profile("0.5.7rc2") is get_profile("0.5.7")
    table = compatibility_table()
    assert "| GET_EXPERIMENTAL id | 40 | 32 | 32 | 32 |" in table
    assert "| CLEAR payload | none | none | [force] | [force] |" in table
