# The two commands of the README: `make demo` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install test test-fast demo bench

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[serve,loadtest,test]'
	rm -f $(VENV)/.installed-* && touch $@

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow"

bench: install
	$(VENV)/bin/specdec bench --batch-sizes 1,8 --json reports/bench.json

demo: install
	$(VENV)/bin/specdec demo

# Serve model_repository/ (the demo kit in build/demo-kit) on tritonserver; Ctrl-C drains and stops it.
.PHONY: serve
SERVE_ARGS ?=
serve: install
	$(PY) -m specdec.serving.server --model-repository model_repository $(SERVE_ARGS)
