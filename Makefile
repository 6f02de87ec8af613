# `make serve` and `make test` each do all the set-up on a fresh machine: a .venv, the package, then the run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# Until the OpenAI server lands, `make serve` generates from the demo model (random weights: gibberish by design).
serve: $(STAMP)
	$(BIN)/strata generate --model demo --prompt "Hello from Strata" --max-tokens 48

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q tests

bench: $(STAMP)
	$(BIN)/python bench/engine_speed.py --model demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
