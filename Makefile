# The two commands a user types: `make run` and `make test`. Each does its own set-up.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
PYTHON ?= python3
CMAKE_FLAGS ?=
# CI builds turn compiler warnings into errors (the tree builds clean with -Wall -Wextra).
ifneq ($(CI),)
CMAKE_FLAGS += -DTGIS_WERROR=ON
endif

.PHONY: all deps build test unit-test integration-test bench bench-gpu gpu-bundle run format clean \
	fixtures

all: build

deps:
	@bash scripts/deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS)

build: deps $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS)

unit-test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

integration-test: build
	TGIS_BUILD_DIR=$(abspath $(BUILD_DIR)) $(PYTHON) -m pytest -q tests/integration

# ctest and pytest both run; the target fails if either failed. Each integration file runs in
# its own pytest process, so that native state of one (gRPC channels, servers) cannot reach
# another's (a grpcio object finalized during a later file's garbage collection crashed once).
test: build
	@rc=0; \
	(cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)) || rc=1; \
	for f in tests/integration/test_*.py; do \
	  TGIS_BUILD_DIR=$(abspath $(BUILD_DIR)) $(PYTHON) -m pytest -q $$f || rc=1; \
	done; \
	exit $$rc

bench: build
	$(PYTHON) benchmarks/tokenizer_bench.py --build-dir $(BUILD_DIR)
	$(PYTHON) benchmarks/engine_bench.py --build-dir $(BUILD_DIR)

# On a machine with a GPU (builds with nvcc): the Llama-3-8B-shaped benchmark against HF.
bench-gpu: build
	$(PYTHON) benchmarks/gpu_bench.py --build-dir $(BUILD_DIR)

# For the device tool's GPU machine, which has no C++ dependencies: .device/ with the
# binaries and libraries (see scripts/gpu_checks.sh).
gpu-bundle: build
	BUILD_DIR=$(BUILD_DIR) bash scripts/gpu_bundle.sh

run: build
	BUILD_DIR=$(BUILD_DIR) bash scripts/run_demo.sh

fixtures:
	$(PYTHON) tests/fixtures/make_tokenizer_fixtures.py

format:
	find common kernels launcher metrics router server tokenizer tests benchmarks \
	  \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
