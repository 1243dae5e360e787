"""The wheel carries every module of the tree and the top-level pickle_templates/
(installed as lmcache_mp.pickle_templates), and an installed wheel emits pickles."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}")
    (whl,) = out.glob("lmcache_mp-*.whl")
    return whl


def test_wheel_carries_every_module_and_the_templates(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(REPO)) for p in (REPO / "lmcache_mp").rglob("*.py")}
    expected |= {"lmcache_mp/py.typed"}
    expected |= {f"lmcache_mp/pickle_templates/{p.name}"
                 for p in (REPO / "pickle_templates").iterdir()
                 if p.suffix in (".json", ".py", ".md")}
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}: list new packages in pyproject.toml"
    assert any(n.endswith("v0_5_3_cpu_shm.json") for n in names)


def test_installed_wheel_emits_from_its_own_templates(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(target), str(wheel)], check=True)
    code = "\n".join([
        "import sys",
        f"sys.path.insert(0, {str(target)!r})",
        "import lmcache_mp.pickle_templates as t, lmcache_mp.protocol.pickles.emitter as e",
        f"assert t.__file__.startswith({str(target)!r}), t.__file__",
        "b = e.emit_cpu_shm_wrapper(shm_name='/x', nbytes=8, dtype='float16', shape=(4,),"
        " stride=(1,))",
        "assert b[:2] == bytes([0x80, 4])",
        "print('ok')",
    ])
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
