# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidal-installed

.PHONY: install demo test lint format clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tidal.demo

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests examples benchmarks
	$(VENV)/bin/ruff format src tests examples benchmarks

clean:
	rm -rf outputs .pytest_cache .mypy_cache .ruff_cache
