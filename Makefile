# Two commands do all the set-up: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit test-distributed bench clean horovod

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m commopt demo

test: setup
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-distributed: setup
	$(PY) -m pytest -q tests/distributed $(PYTEST_ARGS)

# The step benchmark's default comparison: DDP against commopt on both models, every
# configuration, 3 rounds, 2 emulated hosts on 1 Gbit/s links (root for the link, else loopback,
# said so); about 11 minutes on 2 cores. Options through BENCH_ARGS, e.g.
# make bench BENCH_ARGS="--models mlp --json step.json" (see docs/benchmarks-step.md).
BENCH_ARGS ?=
bench: setup
	$(PY) -m commopt bench step $(BENCH_ARGS)

# Horovod 0.28.1 from source against the pinned torch (the wheel is kept in .horovod/).
horovod: setup
	bash scripts/build_horovod.sh $(VENV)

clean:
	rm -rf build *.egg-info commopt_ext/*.so .pytest_cache
