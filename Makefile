# `make serve` and `make test` each do all the set-up on a fresh machine: a .venv, the package, then the run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test check bench docs train-tiny clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,sycl,ray]'
	touch $(STAMP)

# The OpenAI-compatible server on 127.0.0.1:8080, serving the built-in tiny model (trained on Python's documentation:
# it answers in doc-like English; `strata serve` with no --model serves the random-weights demo model);
# ARGS="--parallel 4 ..." passes flags.
serve: $(STAMP)
	$(BIN)/strata serve --model tiny $(ARGS)

# lint-imports: ARCHITECTURE.md's layer order (pyproject.toml's [tool.importlinter]) before the tests. Compilations
# are kept in ~/.cache/strata/jax-test-cache (tests/conftest.py), so a second run loads them.
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -n 2 --dist loadfile -q --durations=30 tests

# The inner loop: the import contracts and the quick test files (tests/file_seconds.json), in under 2 minutes.
check: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -n 2 --dist loadfile -q --quick tests

bench: $(STAMP)
	$(BIN)/python bench/engine_speed.py --model demo

# Retrain the built-in tiny model from scratch, as committed (under an hour on 2 idle CPU cores): the checkpoint, its
# training log and its loss curves. See docs/tiny-model.md.
train-tiny: $(STAMP)
	$(BIN)/pip install -q -e '.[train]'
	$(BIN)/strata train-tiny --out strata/models/tiny --log bench/results/tiny_training.jsonl --plot docs/tiny-loss.png

# docs/configuration.md and configs/demo.toml, generated from strata/config.py and strata/cli.py
docs: $(STAMP)
	$(BIN)/python -c "from strata.cli import configuration_markdown as m; print(m(), end='')" > docs/configuration.md
	$(BIN)/python -c "from strata.config import demo_toml as t; print(t(), end='')" > configs/demo.toml

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
