# make demo   - set everything up, start a real LMCache server, run the demo, stop it
# make test   - set everything up, lint, type-check, run the whole suite (starts servers itself)
PY ?= python3
VENV := .venv

.PHONY: setup oracle demo test lint unit fixtures bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check --upgrade pip
	# torch first and pinned (a CPU build on local disk): it enables the torch views of
	# CpuKVCache in the tests; a bare torch requirement would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

oracle:
	scripts/lmcache-server.sh install >/dev/null

demo: setup oracle
	scripts/demo.sh

lint: setup
	$(VENV)/bin/ruff check lmcache_mp tests tools benchmarks examples
	$(VENV)/bin/mypy

unit: setup
	LMCACHE_MP_SKIP_LIVE=1 $(VENV)/bin/python -m pytest -q

test: setup oracle lint
	$(VENV)/bin/python -m pytest -q -ra

fixtures: oracle
	scripts/lmcache-server.sh python -- tools/gen_fixtures.py

bench: setup oracle
	scripts/lmcache-server.sh python -- benchmarks/control_plane.py

clean:
	rm -rf $(VENV) .oracle lmcache_mp.egg-info .pytest_cache .mypy_cache .ruff_cache
