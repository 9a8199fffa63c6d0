# The two commands a user types: `make run` and `make test`. Each does its own set-up.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
PYTHON ?= python3
CMAKE_FLAGS ?=
# CI builds turn compiler warnings into errors (the tree builds clean with -Wall -Wextra).
ifneq ($(CI),)
CMAKE_FLAGS += -DTGIS_WERROR=ON
endif

.PHONY: all deps build test unit-test integration-test bench bench-cpu bench-gpu gpu-bundle run format clean \
	fixtures fuzz-build fuzz-smoke fuzz test-asan test-tsan

# Sanitizer builds use clang (libFuzzer comes with it) and no CUDA: one tree for AddressSanitizer
# + UndefinedBehaviorSanitizer and the fuzz targets, one for ThreadSanitizer.
ASAN_BUILD_DIR ?= build-asan
TSAN_BUILD_DIR ?= build-tsan
SAN_CMAKE_FLAGS = -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTGIS_CUDA=OFF \
	-DCMAKE_BUILD_TYPE=RelWithDebInfo
# Seconds per fuzz target: a bounded run in `make test`, a long one in `make fuzz`.
FUZZ_SECONDS ?= 20
FUZZ_LONG_SECONDS ?= 600
export ASAN_OPTIONS ?= detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=1
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS ?= halt_on_error=1:second_deadlock_stack=1

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

# ctest, pytest and the bounded fuzz runs all run; the target fails if any failed. The
# integration suite runs in one pytest process, as a user would run it (tgis_proto runs
# protoc in a child process, so grpc_tools' protobuf runtime never sits beside
# sentencepiece's in it).
INTEGRATION = TGIS_BUILD_DIR=$(abspath $(1)) $(PYTHON) -X faulthandler -m pytest -q \
	  tests/integration || rc=1

test: build fuzz-build
	@rc=0; \
	(cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)) || rc=1; \
	$(call INTEGRATION,$(BUILD_DIR)); \
	FUZZ_SEED=1 bash scripts/fuzz.sh $(ASAN_BUILD_DIR) $(FUZZ_SECONDS) || rc=1; \
	exit $$rc

$(ASAN_BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(ASAN_BUILD_DIR) $(SAN_CMAKE_FLAGS) -DTGIS_SANITIZE=address,undefined \
	  -DTGIS_FUZZ=ON $(CMAKE_FLAGS)

$(TSAN_BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(TSAN_BUILD_DIR) $(SAN_CMAKE_FLAGS) -DTGIS_SANITIZE=thread $(CMAKE_FLAGS)

# The libFuzzer targets (tests/fuzz), built with ASan + UBSan.
fuzz-build: deps $(ASAN_BUILD_DIR)/CMakeCache.txt
	cmake --build $(ASAN_BUILD_DIR) -j $(JOBS) --target fuzz_targets

fuzz-smoke: fuzz-build
	FUZZ_SEED=1 bash scripts/fuzz.sh $(ASAN_BUILD_DIR) $(FUZZ_SECONDS)

fuzz: fuzz-build
	bash scripts/fuzz.sh $(ASAN_BUILD_DIR) $(FUZZ_LONG_SECONDS)

# Unit and integration tests on binaries built with AddressSanitizer + UndefinedBehaviorSanitizer.
test-asan: deps $(ASAN_BUILD_DIR)/CMakeCache.txt
	cmake --build $(ASAN_BUILD_DIR) -j $(JOBS)
	@rc=0; \
	(cd $(ASAN_BUILD_DIR) && ctest --output-on-failure -j $(JOBS)) || rc=1; \
	$(call INTEGRATION,$(ASAN_BUILD_DIR)); \
	exit $$rc

# The router's unit tests (queue, batcher, reactors, health) under ThreadSanitizer.
test-tsan: deps $(TSAN_BUILD_DIR)/CMakeCache.txt
	cmake --build $(TSAN_BUILD_DIR) -j $(JOBS) --target router_test
	$(TSAN_BUILD_DIR)/tests/router_test

bench: build
	$(PYTHON) benchmarks/tokenizer_bench.py --build-dir $(BUILD_DIR)
	$(PYTHON) benchmarks/engine_bench.py --build-dir $(BUILD_DIR)

# CPU decode/prefill against llama.cpp and CTranslate2 on a TinyLlama-shaped random checkpoint
# (tens of minutes the first time: builds llama.cpp, converts; see benchmarks/README.md).
bench-cpu: build
	$(PYTHON) benchmarks/cpu_bench.py --build-dir $(BUILD_DIR)

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
