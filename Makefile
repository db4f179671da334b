PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test bench peer clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/gdnspec serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/gdnspec bench step $(ARGS)

# llama.cpp as a benchmark peer (llama-cpp-python). This compiles llama.cpp; with
# CMAKE_ARGS="-DLLAMA_BUILD=OFF" it installs only the Python package, which then loads the
# libllama.so in the folder named by LLAMA_CPP_LIB_PATH (see README.md, Benchmarks).
peer: $(STAMP)
	$(BIN)/pip install -e '.[peer]'

clean:
	rm -rf $(VENV) build *.egg-info
