# Two commands do all the set-up: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# libtpu (the `tpu` extra) and the CUDA plugin with ptxas (`gpu-compile`) let the tests
# compile for real TPUs and GPUs on this host.
TEST_STAMP := $(VENV)/.installed-tpu-gpu
# A checkout keeps its generated models and XLA cache in .cache/ (lp_jax/paths.py), so
# that `make demo` and `make test` train the demo model once between them.
export LP_JAX_CACHE_DIR ?= $(CURDIR)/.cache

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

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,tpu,gpu-compile]'
	@touch $(TEST_STAMP)

test: $(TEST_STAMP)
	JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8 $${XLA_FLAGS:-}" $(PY) -m pytest -n 2 --dist loadfile tests $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
