# Two commands matter: `make demo` (the main job) and `make test` (the suite CI runs; then `make e2e`).
# Each creates the virtualenv it needs on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# make test's pytest workers: the suite mostly waits on sockets and subprocesses, so more workers than
# cores pay off (2 cores: 4 workers; tests/conftest.py keeps tests sharing a session fixture together).
TEST_WORKERS ?= 4

.PHONY: venv test e2e lint demo demo-prewarm render crds chart release bench bench-pool-day clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	touch $(STAMP)

venv: $(STAMP)

# Before pytest, outside every per-test timeout: build or fetch the third-party programs the target's
# tests need (etcd, kube-apiserver, helm, promtool, docker-registry; for e2e also kwok, KEDA's operator,
# Metacontroller), with progress lines; cached after the first run (tests/setup.py, docs/install.md).
# pytest exits 5 when it collected nothing: that is a broken suite, so say it and fail loudly.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m tests.setup test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=15; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; failing" >&2; exit 1; fi; exit $$rc

# The lifecycle suite: real kube-apiserver, real Metacontroller (built from ../shared's source into
# ~/.cache), Noctaya's hook server; see tests/e2e/. Skips with the reason where a part cannot be had.
e2e: $(STAMP)
	$(PY) -m tests.setup e2e
	$(PY) -m tests.e2e.run

lint: $(STAMP)
	$(PY) -m ruff check .

# ENGINE=llamacpp: llama.cpp's real llama-server (built once if need be, 4-12 min on 2 cores) with a tiny random GGUF
# delivered through the prewarm path; ENGINE=standin: demo/backend.py; default: the real one once built.
ENGINE ?= auto
demo: $(STAMP)
	$(PY) -m demo --engine $(ENGINE)

# Model delivery: a prewarm Job (the rendered one's command) fills a cache from a stand-in hub, then
# the backend starts from it (see docs/model-delivery.md).
demo-prewarm: $(STAMP)
	$(PY) -m demo.prewarm

render: $(STAMP)
	$(PY) -m hooks render examples/runtimes examples/models examples/gateways

crds: $(STAMP)
	$(PY) -m hooks.crdgen --out crds --api-reference docs/api.md

# charts/noctaya's CRDs and generated-*.yaml templates from crds/ and metacontroller/ (run after `make crds`).
chart: $(STAMP)
	$(PY) tools/chart/generate.py

# A new release version in hooks/version.py and every copy of it, then the chart regenerated
# (tools/release.py; docs/releasing.md): make release VERSION=0.3.0
release: $(STAMP)
	@test -n "$(VERSION)" || { echo "make release: give the new version, e.g. make release VERSION=0.3.0" >&2; exit 2; }
	$(PY) tools/release.py $(VERSION)

# Every benchmark, then the warm path's, the replicas', the idle footprint's, the idle members' and the
# attacks' targets side by side (about 18.5 min; make bench BENCH_ARGS=--quick: about 7 min, shorter rounds and windows).
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

# A day of a 12-model platform on 4 GPUs, with and without an AcceleratorPool, on the e2e harness's
# cluster (about 20 min; docs/benchmarks.md). Builds the e2e dependencies first, as `make e2e` does.
# Options: make bench-pool-day POOL_DAY_ARGS="--only zero,pool --ready-grace 1.5"
bench-pool-day: $(STAMP)
	$(PY) -m tests.setup e2e
	$(PY) -m bench.pool_day $(POOL_DAY_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
