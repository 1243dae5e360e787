"""The ERROR lines a protocol probe leaves in a real server's log (issue 37).

Every process that connects with ``protocol="auto"`` probes the server, and each
question a release cannot answer is an ERROR line (with a traceback) in its log: an
operator of many nodes sees them at every engine start, from every worker. The probe
asks its questions in the order that costs the newest releases nothing (see
``protocol/detect.py``); naming the family sends no probe. These counts are measured
on the real servers and must never grow.
"""

from __future__ import annotations

import time

import pytest

from lmcache_mp import Client
from lmcache_mp.cli import main as cli_main

from ..conftest import SERVER_VERSION, LiveServer
from ..support.probe_replay import PROBE_ERROR_LINES, error_records, is_probe_error

pytestmark = pytest.mark.live


def settled_errors(server: LiveServer, since: int) -> list[str]:
    """The ERROR lines logged since ``since``, once the log has stopped growing (the
    server logs a dropped question on its message thread, before the fence that ends
    the probe is answered; the wait covers a slow flush)."""
    size, still = len(server.log), 0
    while still < 3:
        time.sleep(0.1)
        now = len(server.log)
        still = still + 1 if now == size else 0
        size = now
    return error_records(server.log[since:])


def test_a_probe_leaves_the_fewest_error_lines_and_a_named_family_none(
        private_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    server = private_server
    before = len(server.log)
    assert cli_main(["info", server.url, "--samples", "3"]) == 0
    out = capsys.readouterr().out
    probed = settled_errors(server, before)
    assert len(probed) == PROBE_ERROR_LINES[SERVER_VERSION], probed
    assert all(map(is_probe_error, probed)), probed
    # info says what to paste to skip the probe everywhere ...
    family = {"0.5.3": "0.5.3", "0.5.4": "0.5.3", "0.5.5": "0.5.5", "0.5.6": "0.5.6",
              "0.5.7rc2": "0.5.7"}[SERVER_VERSION]
    assert f'"lmcache.mp.protocol": "{family}"' in out
    assert f"protocol={family!r}" in out and f"--protocol {family}" in out
    # ... and with the family named, nothing reaches the log.
    before = len(server.log)
    with Client(server.url, timeout=5.0, protocol=family) as client:
        assert client.noop() == "OK" and client.chunk_size() > 0
        assert client.detection is None
    assert cli_main(["info", server.url, "--samples", "3", "--protocol", family]) == 0
    assert "lmcache.mp.protocol" not in capsys.readouterr().out
    assert settled_errors(server, before) == []
