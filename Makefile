# Two commands on a fresh machine: `make demo` and `make test`. Both create or reuse .venv and install what
# they need; the stamp file makes the second run skip pip when the requirement files have not changed.
# `make test-vllm` does the same with .venv-vllm and runs real vLLM engines (tests/vllm).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tensorwire-installed

# Keep UCX on loopback and quiet on these CPU machines (nixl-on-cpu.md §5); the library sets its own
# per-process defaults too, these only make the CLI and tests reproducible.
export NIXL_LOG_LEVEL ?= WARN
export PYTHONUNBUFFERED := 1

.PHONY: install test test-unit test-gpu test-long test-vllm install-vllm lint demo proto clean fuzz soak load

install: $(STAMP)

$(STAMP): pyproject.toml requirements/dev.txt requirements/nixl.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/nixl.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Under coverage (pyproject.toml [tool.coverage]); the last line printed is the figure.
test: install
	$(PY) -m coverage run -m pytest -m "not gpu and not slow and not vllm" -q --ignore=tests/vllm
	@echo "line coverage of src/tensorwire in the pytest process: $$($(PY) -m coverage report --format=total)%"

# The quick loop while editing: the unit tests alone (one process each, loopback only; docs/development.md).
test-unit: install
	$(PY) -m pytest tests/unit -m "not gpu and not slow and not vllm" -q

# End to end with real vLLM engines on CPU (tests/vllm, docs/vllm.md): a separate virtualenv, because vLLM pins its
# own transformers. The registry's torchaudio/torchcodec wheels link CUDA torch and break `import transformers`
# on the CPU build, so they are removed; torchvision (vLLM's multimodal code imports it) stays, made importable by
# the test-only startup hook tests/vllm/venv_site (see its docstring).
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.tensorwire-installed
VLLM_PIP   := $(VLLM_PY) -m pip -q --disable-pip-version-check

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml requirements/vllm.txt requirements/nixl.txt tests/vllm/venv_site/_tensorwire_tv_cpu.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -r requirements/vllm.txt
	$(VLLM_PIP) uninstall -y torchaudio torchcodec
	$(VLLM_PIP) install --no-deps -r requirements/nixl.txt
	$(VLLM_PIP) install --no-deps --no-build-isolation -e .
	cp tests/vllm/venv_site/_tensorwire_tv_cpu.py tests/vllm/venv_site/_tensorwire_tv_cpu.pth \
	   "$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	mkdir -p build
	$(VLLM_PY) -m pytest tests/vllm -m vllm -q -p no:cacheprovider --basetemp=build/test-vllm

# ruff and mypy, both configured in pyproject.toml: mypy --strict on src/, and tests/ with check_untyped_defs.
lint: install
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts
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
	rm -rf $(VENV) $(VLLM_VENV) build dist src/*.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
