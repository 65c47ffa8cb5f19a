# Two commands on a fresh machine: `make demo` and `make test`. Both create or reuse .venv and install what
# they need; the stamp file makes the second run skip pip when the requirement files have not changed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tensorwire-installed

# Keep UCX on loopback and quiet on these CPU machines (nixl-on-cpu.md §5); the library sets its own
# per-process defaults too, these only make the CLI and tests reproducible.
export NIXL_LOG_LEVEL ?= WARN
export PYTHONUNBUFFERED := 1

.PHONY: install test test-gpu test-long lint demo proto clean fuzz soak load

install: $(STAMP)

$(STAMP): pyproject.toml requirements/dev.txt requirements/nixl.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/nixl.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: install
	$(PY) -m pytest -m "not gpu and not slow" -q

# ruff and mypy --strict, both configured in pyproject.toml (mypy checks src/ only).
lint: install
	$(PY) -m ruff check src tests scripts
	$(PY) -m mypy

test-gpu: install
	$(PY) -m pytest -m gpu -q

test-long: install
	$(PY) -m pytest -m slow -q

demo: install
	$(PY) -m tensorwire.cli.main demo

# Reliability (docs/reliability.md): long fuzz run (hypothesis with many examples, then 1,000,000 inputs through
# the fuzz driver), the 10-minute soak at concurrency 16 with every fault kind, and the closed-loop load run.
fuzz: install
	TENSORWIRE_FUZZ_EXAMPLES=5000 $(PY) -m pytest tests/fuzz -q
	$(PY) -m tensorwire.soak.fuzz --inputs 1000000 --save

soak: install
	$(PY) -m tensorwire.cli.main soak --duration 600 --concurrency 16 --faults all --seed 11 --save

load: install
	$(PY) -m tensorwire.cli.main soak --load --duration 180 --concurrency 64 --save

# Regenerates the protobuf modules from the .proto files (see scripts/gen_proto.py for why it post-processes).
proto: install
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
