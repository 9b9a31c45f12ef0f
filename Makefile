# Two entry points, each sets itself up on a fresh machine:
#   make demo   the main job
#   make test   the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade --quiet pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

.PHONY: setup demo test bench
setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hpkv bench

test: $(STAMP)
	$(VENV)/bin/pytest -q

bench: demo
