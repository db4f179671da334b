PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-long bench peer gpu-check gpu-quick gpu-wheels clean

$(STAMP): pyproject.toml $(wildcard jaxmodel/kernels/*.cc jaxmodel/kernels/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python -c "from jaxmodel.kernels import cpu_matmul; print('CPU kernels:', cpu_matmul.build())" \
		|| echo "CPU kernel not built (no C++ compiler?): the model uses XLA's products"
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/gdnspec serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The long tests (`long_test` in tests/conftest.py: the 0.8B preset's shapes, the tiny qwen3next's prefix cache,
# serving from two processes): minutes on 2 cores, so not in `make test`.
test-long: $(STAMP)
	GDNSPEC_LONG_TESTS=1 $(BIN)/python -m pytest tests/test_prefix_cache.py tests/test_sharding.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/gdnspec bench step $(ARGS)

# llama.cpp as a benchmark peer (llama-cpp-python). This compiles llama.cpp; with
# CMAKE_ARGS="-DLLAMA_BUILD=OFF" it installs only the Python package, which then loads the
# libllama.so in the folder named by LLAMA_CPP_LIB_PATH (see README.md, Benchmarks).
peer: $(STAMP)
	$(BIN)/pip install -e '.[peer]'

# On a GPU machine: the test suite with Pallas kernels compiled (not interpreted), then the kernel, step,
# engine and speculation benchmarks, their JSON in bench/results/gpu/. GPU_PYTHON is a Python whose JAX has CUDA
# (and the project's dependencies); the repository root is on its path.
GPU_PYTHON ?= python3
GPU_OUT := bench/results/gpu
GPU_MODEL := bench/out/qwen35-0.8b-f32.gguf

gpu-check:
	mkdir -p $(GPU_OUT) bench/out
	$(GPU_PYTHON) -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
	$(GPU_PYTHON) -m pytest -q $(PYTEST_ARGS) --junitxml=$(GPU_OUT)/pytest.xml
	$(GPU_PYTHON) -m bench.gdn_kernels $(GPU_OUT)/gdn-kernels.json --dtype bfloat16
	test -f $(GPU_MODEL) || $(GPU_PYTHON) -m api.cli make-random --preset qwen35-0.8b $(GPU_MODEL)
	$(GPU_PYTHON) -m bench.step --model $(GPU_MODEL) --batches 1,8,32 --verify-t 1,4,8 --out $(GPU_OUT)/step-0.8b.json
	$(GPU_PYTHON) -m bench.engine --model $(GPU_MODEL) --concurrency 1,32 --out $(GPU_OUT)/engine-0.8b.json
	$(GPU_PYTHON) -m bench.speculation --streams 1,32 --out $(GPU_OUT)/speculation.json

# The few GPU measurements needed next, within a time budget (bench/gpu_quick.sh): GPU_BUDGET seconds in all.
GPU_BUDGET ?= 570
gpu-quick:
	GPU_PYTHON=$(GPU_PYTHON) bench/gpu_quick.sh $(GPU_OUT) $(GPU_BUDGET)

# Wheels for a GPU machine's Python 3.12 that has JAX but not these (carried there in .whl/, installed by gpu-quick).
GPU_WHEELS := msgspec==0.22.0 gguf==0.19.0 websockets==17.4 prometheus-client==0.26.0
gpu-wheels: $(STAMP)
	rm -f .whl/*.whl  # one version of each: pip refuses two
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info
