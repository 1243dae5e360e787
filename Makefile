# make demo   - set everything up, start a real LMCache server, run the demo, stop it
# make test   - set everything up, lint, type-check, run the whole suite against every
#               supported LMCache release (starts and stops the servers itself)
PY ?= python3
VENV := .venv

.PHONY: setup oracle demo test lint unit fixtures bench readme clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check --upgrade pip
	# torch first and pinned (a CPU build on local disk): it enables the torch views of
	# CpuKVCache in the tests; a bare torch requirement would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

RELEASES := 0.5.3 0.5.4 0.5.5 0.5.6

oracle:
	for v in $(RELEASES); do scripts/lmcache-server.sh install --version $$v >/dev/null || exit 1; done

demo: setup oracle
	scripts/demo.sh

lint: setup
	$(VENV)/bin/ruff check lmcache_mp tests tools benchmarks examples scripts
	$(VENV)/bin/mypy

unit: setup
	LMCACHE_MP_SKIP_LIVE=1 $(VENV)/bin/python -m pytest -q

# The whole suite against 0.5.3, then the live tests against every other release.
test: setup oracle lint
	$(VENV)/bin/python -m pytest -q -ra
	for v in $(filter-out 0.5.3,$(RELEASES)); do \
	  echo "== live tests against LMCache $$v"; \
	  LMCACHE_MP_SERVER_VERSION=$$v $(VENV)/bin/python -m pytest -q -ra -m live || exit 1; \
	done

readme: setup
	$(VENV)/bin/python tools/update_readme.py

fixtures: oracle
	for v in $(RELEASES); do scripts/lmcache-server.sh python --version $$v -- tools/gen_fixtures.py || exit 1; done
	scripts/lmcache-server.sh python -- tools/gen_pickle_fixtures.py

bench: setup oracle
	scripts/lmcache-server.sh python -- benchmarks/control_plane.py
	scripts/lmcache-server.sh python -- benchmarks/data_plane.py

clean:
	rm -rf $(VENV) .oracle lmcache_mp.egg-info .pytest_cache .mypy_cache .ruff_cache
