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


def test_engine_jobs_exactly_where_real_engines_run() -> None:
    """The real-engine jobs (``engines-REL``) match test_real_engine.py's
    ENGINE_RELEASES: a job for another release would start a server to skip every test,
    and one missing would leave that release's real engines out of ``make test``."""
    from tests.integrations.vllm import test_real_engine

    rs = run_suites()
    releases = makefile_releases()
    engines = [j.name for j in rs.jobs_for(releases, None) if j.name.startswith("engines-")]
    assert rs.ENGINE_RELEASES == test_real_engine.ENGINE_RELEASES
    assert sorted(engines) == sorted(f"engines-{r}" for r in rs.ENGINE_RELEASES)
    assert set(rs.ENGINE_RELEASES) <= set(releases)
