# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= models/mamba2-tiny-pystdlib
HOST   ?= 127.0.0.1
PORT   ?= 30000
STAMP  := $(VENV)/.installed

.PHONY: install serve test clean

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/mambaserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
