# Two commands do all the set-up: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml launch/find_python.sh
	@PYTHON=$$(bash launch/find_python.sh) && \
	  { [ -x $(PY) ] || $$PYTHON -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m lp_jax.demo

test: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 $${XLA_FLAGS:-}" $(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
