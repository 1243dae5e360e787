"""Oracle tests run or fail where the oracle is expected; they skip only elsewhere
(tests/conftest.py:oracle_python)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import oracle_python


def test_a_missing_oracle_fails_under_ci(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setenv("LMCACHE_MP_ORACLE_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="oracle venv is missing"):
        oracle_python("0.5.3")


def test_a_missing_venv_fails_where_an_oracle_directory_exists(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMCACHE_MP_ORACLE_DIR", str(tmp_path))  # exists, no venv in it
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.fail.Exception, match="install it with"):
        oracle_python("0.5.6")


def test_a_missing_oracle_only_skips_off_ci(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("LMCACHE_MP_ORACLE_DIR", str(tmp_path / "absent"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        oracle_python("0.5.3")


def test_an_installed_oracle_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    python = tmp_path / "venv-0.5.5" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setenv("LMCACHE_MP_ORACLE_DIR", str(tmp_path))
    assert oracle_python("0.5.5") == python
