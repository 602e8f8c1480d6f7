# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= models/mamba2-tiny-pystdlib
HOST   ?= 127.0.0.1
PORT   ?= 30000
STAMP  := $(VENV)/.installed

.PHONY: install serve test clean tools image-tools test-images

SERVE_STAMP := $(VENV)/.installed-server

# What serving needs alone (requirements-server.txt + the package): `make serve` on a fresh clone.
$(SERVE_STAMP): requirements-server.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-server.txt
	# (an isolated build: a fresh venv's setuptools is too old for pyproject.toml; pip fetches its own)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(SERVE_STAMP)

# Everything else: the operator, the kernels' Triton and the tests' tools (`make test`).
$(STAMP): $(SERVE_STAMP) requirements.txt requirements-operator.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $(STAMP)

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/mambaserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# promtool and prometheus (Debian's package) for tests/charts, installed when missing (as root, or via sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools:
	@command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq prometheus; }

test: $(STAMP) tools
	$(BIN)/python -m pytest -q -p no:cacheprovider

# Both images built from this checkout and run here (tests/images: buildah and debootstrap, as root;
# about 14 minutes the first time, 2.5 to 7 once the local bases are cached). Not part of `make test`.
image-tools:
	@command -v buildah >/dev/null && command -v debootstrap >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq buildah debootstrap; }

test-images: $(STAMP) image-tools
	MAMBASERVE_IMAGE_TESTS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/images

clean:
	rm -rf $(VENV) build *.egg-info
