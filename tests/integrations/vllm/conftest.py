"""A failed vLLM test shows the logs of the engines it ran (``engines.ENGINE_LOGS``):
the assertion says what was loaded, the engine's log says why (a RETRIEVE refused, a
registration retried, a server not answering), which a rare failure in CI needs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.vllm.engines import ENGINE_LOGS

LOG_TAIL = 6000  # characters of each engine's log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    if call.when == "setup":
        ENGINE_LOGS.clear()
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for i, (what, log) in enumerate(ENGINE_LOGS, 1):
            report.sections.append((f"engine {i} ({what}): log tail", log[-LOG_TAIL:]))
