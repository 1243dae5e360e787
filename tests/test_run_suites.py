"""tools/run_suites.py's job list (``make test``) against what the tests it runs select."""

from __future__ import annotations

import re
from types import ModuleType

from tests.conftest import REPO
from tests.support.tool_modules import load_tool


def run_suites() -> ModuleType:
    return load_tool("run_suites")


def makefile_releases() -> list[str]:
    m = re.search(r"^RELEASES := (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "the Makefile's RELEASES line"
    return m.group(1).split()


def test_an_alone_job_only_where_its_test_runs() -> None:
    """The TP=2 engine (marked ``alone``) runs against one release; an ``alone`` job
    for another release would only collect the suite to skip it, and one missing for
    that release would leave the TP=2 engine out of ``make test`` without a word."""
    from tests.integrations.vllm import test_real_engine

    rs = run_suites()
    releases = makefile_releases()
    alone = [j.name for j in rs.jobs_for(releases, None) if j.alone]
    assert rs.ALONE_RELEASES == (test_real_engine.SEVERAL_PROCESS_RELEASE,)
    assert alone == [f"alone-{r}" for r in rs.ALONE_RELEASES]
    assert set(rs.ALONE_RELEASES) <= set(releases)
