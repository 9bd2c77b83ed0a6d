# Two commands matter: `make demo` and `make test`. Both create .venv on first use.
# TORCH_SPEC pins the CPU build of torch that CPU machines install locally; a GPU
# machine may override it, e.g. `make test TORCH_SPEC='torch==2.13.0 --index-url ...'`.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
COOKBOOK_SPEC ?= tinker-cookbook==0.6.1
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.twinkle-installed
# Every distribution in the workspace, installed editable; twinkle-all last (it only pins siblings).
PACKAGES := $(sort $(dir $(wildcard packages/*/pyproject.toml kernels/pyproject.toml)))
EDITABLES := $(foreach p,$(filter-out packages/twinkle-all/,$(PACKAGES)),-e $(p)) $(if $(wildcard packages/twinkle-all/pyproject.toml),-e packages/twinkle-all/)
PYPROJECTS := $(wildcard packages/*/pyproject.toml kernels/pyproject.toml) requirements-dev.txt \
	integration-tests/server/requirements-tinker-cookbook.txt

# vLLM's own venv for `make test-vllm` (see packages/twinkle-sampler/requirements-vllm-cpu.txt); only the
# distributions, installed editable (the server with its Tinker API, for the server's vLLM tests; the model
# with megatron-core, for seed 000's listing, which trains a MegatronModel and samples with vLLM).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.twinkle-installed
VLLM_REQUIREMENTS := packages/twinkle-sampler/requirements-vllm-cpu.txt
VLLM_OWN := packages/twinkle-all/ packages/twinkle-server/ packages/twinkle-model/
VLLM_EDITABLES := $(foreach p,$(filter-out $(VLLM_OWN),$(PACKAGES)),-e $(p)) \
	-e 'packages/twinkle-server[tinker]' -e 'packages/twinkle-model[megatron]'
VLLM_TESTS := packages/twinkle-sampler/tests $(wildcard packages/twinkle-server/tests/test_vllm_*.py) \
	integration-tests/test_seed_000.py

.PHONY: install demo test test-vllm lint clean

install: $(STAMP)

$(STAMP): $(PYPROJECTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_SPEC)
	$(PIP) install --quiet $(EDITABLES) -r requirements-dev.txt
	# tinker-cookbook without its tml-renderers requirement (not on the index; only Inkling/Kimi models use it)
	$(PIP) install --quiet --no-deps $(COOKBOOK_SPEC)
	touch $(STAMP)

# The main job on the embedded default: LoRA SFT on self-cognition, then the model answers.
demo: install
	$(PY) cookbook/sft/self_cognition.py

# glibc hands every freed block over 32 MB back to the kernel, so CPU training, which allocates and frees
# [tokens, 151,936-vocabulary] buffers every step, pays for their pages again at each step: a fifth of the
# suite's CPU time was system time. Blocks under 1 GiB stay in the heap for reuse with these tunables (other C
# libraries ignore them; an exported GLIBC_TUNABLES wins).
GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824

# Every test in TEST_WORKERS processes (pytest-xdist), a test file per worker at a time, in collection order
# (integration tests first, see conftest.py). The integration tests can share the machine: each starts its
# servers on free 127.0.0.1 ports and its own private Ray.
test: install
	GLIBC_TUNABLES=$(GLIBC_TUNABLES) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=30 packages kernels integration-tests $(PYTEST_ARGS)

# The vLLM sampler's tests (marker `vllm`) against the real engine on CPU, the server's with `sampler: vllm`
# and vLLMSampler as a Ray actor (its private Ray inherits VLLM_ENABLE_V1_MULTIPROCESSING) among them, in
# .venv-vllm (created on first use, reinstalled only when a pyproject, the vLLM requirements or this
# Makefile's list of what goes in change). `make test` skips them: no vllm there.
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -p no:cacheprovider -m vllm $(VLLM_TESTS) $(PYTEST_ARGS)

$(VLLM_STAMP): $(wildcard packages/*/pyproject.toml kernels/pyproject.toml) $(VLLM_REQUIREMENTS) Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet -r $(VLLM_REQUIREMENTS)
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet $(VLLM_EDITABLES)
	$(VLLM_PY) -c "import vllm, ray, twinkle.sampler, twinkle.server.tinker.app"
	touch $(VLLM_STAMP)

# Lint every file, then type-check every package's src/ ([tool.mypy] in pyproject.toml; cache in .mypy_cache).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .mypy_cache
