# `make serve` and `make test` each do all the set-up on a fresh machine: a .venv, the package, then the run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,sycl]'
	touch $(STAMP)

# The OpenAI-compatible server on 127.0.0.1:8080, serving the demo model (random weights: gibberish by design);
# ARGS="--parallel 4 ..." passes flags.
serve: $(STAMP)
	$(BIN)/strata serve $(ARGS)

# lint-imports: ARCHITECTURE.md's layer order (pyproject.toml's [tool.importlinter]) before the tests
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -n 2 --dist loadfile -q tests

bench: $(STAMP)
	$(BIN)/python bench/engine_speed.py --model demo

# docs/configuration.md and configs/demo.toml, generated from strata/config.py and strata/cli.py
docs: $(STAMP)
	$(BIN)/python -c "from strata.cli import configuration_markdown as m; print(m(), end='')" > docs/configuration.md
	$(BIN)/python -c "from strata.config import demo_toml as t; print(t(), end='')" > configs/demo.toml

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
