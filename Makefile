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

# One pip run per target: `make test` on a clean clone installs the test extras in the same
# resolve as the rest (a second run would resolve and build the editable wheel again). The
# venv's own pip (Python 3.12's, 23.2+) installs pyproject editables: no upgrade run.
define install
	@PYTHON=$$(bash launch/find_python.sh) && \
	  { [ -x $(PY) ] || $$PYTHON -m venv $(VENV); }
	$(PY) -m pip install -q -e '.[$(1)]'
endef

$(STAMP): pyproject.toml launch/find_python.sh
	$(call install,dev)
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m lp_jax.demo

TEST_EXTRAS := dev,tpu,gpu-compile
$(TEST_STAMP): pyproject.toml launch/find_python.sh
	$(call install,$(TEST_EXTRAS))
	@touch $(STAMP) $(TEST_STAMP)

test: $(TEST_STAMP)
	JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8 $${XLA_FLAGS:-}" $(PY) -m pytest -n 2 --dist loadfile tests $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
