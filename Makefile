# longmoe: the commands a user types. CMake does the building.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all build demo test test-cuda test-asan bench clean

all: build

$(BUILD)/CMakeCache.txt:
	@command -v cmake >/dev/null || { echo "cmake is required (apt-get install cmake)"; exit 1; }
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/longmoe demo

test: build
	cd $(BUILD) && ctest --output-on-failure -L cpu -j $(JOBS)

test-cuda: build
	cd $(BUILD) && ctest --output-on-failure -L cuda

test-asan:
	$(MAKE) test BUILD=build-asan CMAKE_FLAGS="-DLONGMOE_SANITIZE=ON -DLONGMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug"

bench: build
	./bench/run.sh $(BUILD)

clean:
	rm -rf build build-asan
