# Two commands do all the set-up: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo lint test test-unit test-distributed stress bench clean horovod gpu-check

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m commopt demo

# The guardrails: lint, the formatter's check, the type checker and the import contracts (no
# import cycles, the optimizer's layering), all configured in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two pytest workers, one test file at a time each (pytest-xdist): the multi-rank tests spend
# much of their time waiting on timeouts, links and start-up. `make test TEST_WORKERS=` runs serially.
TEST_WORKERS ?= -n 2 --dist loadfile
test: setup
	$(PY) -m pytest -q -ra $(TEST_WORKERS) $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-distributed: setup
	$(PY) -m pytest -q tests/distributed $(PYTEST_ARGS)

# The multi-rank tests STRESS_N times in a row under a CPU hog on every core, two workers as
# in `make test`; prints each failure with every rank's stacks (scripts/stress.sh, results in
# out/stress). Other tests or pytest options: make stress STRESS_ARGS="tests/distributed/x.py -k y".
STRESS_N ?= 10
STRESS_ARGS ?=
stress: setup
	N=$(STRESS_N) PYTHON=$(PY) bash scripts/stress.sh $(STRESS_ARGS)

# The step benchmark's default comparison: DDP against commopt on both models, every
# configuration, 3 rounds, 2 emulated hosts on 1 Gbit/s links (root for the link, else loopback,
# said so); about 11 minutes on 2 cores. Options through BENCH_ARGS, e.g.
# make bench BENCH_ARGS="--models mlp --json step.json" (see docs/benchmarks-step.md).
BENCH_ARGS ?=
bench: setup
	$(PY) -m commopt bench step $(BENCH_ARGS)

# On a machine with a GPU and a network: CuPy with NCCL for torch's CUDA version (pure_nccl),
# then the device check (scripts/gpu_check.sh: python -m commopt.gpu_check, within 8 minutes;
# on a machine as it comes, without the network, run the script alone). Its result is
# recorded in $(GPU_RESULT) and docs/benchmarks-gpu.md is rendered from it.
GPU_RESULT ?= benchmarks/results/gpu-check.json
GPU_OUT ?= out/gpu-check
GPU_CHECK_ARGS ?=
gpu-check: setup
	@$(PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'make gpu-check needs a GPU: torch ' + torch.__version__ + ' sees none')"
	@cuda=$$($(PY) -c "import torch; print((torch.version.cuda or '').split('.')[0])"); \
	if [ -n "$$cuda" ]; then \
	  $(PY) -m pip install -q -c $(VENV)/constraints.txt "cupy-cuda$${cuda}x" && \
	  $(PY) -c "from cupy.cuda import nccl; assert nccl.available, 'CuPy found no NCCL: pip install nvidia-nccl-cu$$cuda'"; \
	else echo "[gpu-check] ROCm torch: no CuPy/NCCL, pure_nccl is not checked"; fi
	GPU_CHECK_PYTHON=$(PY) OUT=$(GPU_OUT) bash scripts/gpu_check.sh $(GPU_CHECK_ARGS); status=$$?; \
	cp $(GPU_OUT)/gpu-check.json $(GPU_RESULT) && $(PY) -m commopt.gpu_check --docs; exit $$status

# Horovod 0.28.1 from source against the pinned torch (the wheel is kept in .horovod/).
horovod: setup
	bash scripts/build_horovod.sh $(VENV)

clean:
	rm -rf build *.egg-info commopt_ext/*.so .pytest_cache
