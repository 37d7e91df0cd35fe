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
# MODEL=FILE (or NAME=FILE, or a catalog name): the model `make run` and `make gateway` serve
# (default: the embedded Gemma 3 270M)
MODEL ?=
MODEL_ARG := $(if $(MODEL),--model $(MODEL))
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install wheelhouse llama-cmake-args FORCE run serve test test-data test-unit test-model test-e2e check docs prometheus lint format types \
	proto proto-check \
	proto-lint proto-breaking check-min-deps model cluster gateway bench bench-single bench-concurrency bench-strategies bench-prefix \
	bench-tokenize bench-telemetry bench-logprobs bench-overhead bench-grpc-floor bench-grpc-ceiling bench-security bench-models bench-cluster bench-gateway bench-tools bench-kv-tiers bench-speculative bench-build-isa bench-peers bench-aiperf bench-soak bench-backpressure bench-embeddings bench-lora bench-resume-chaos \
	bench-gpu-bundle bench-gpu-cpu clean

install: $(STAMP)

# llama-cpp-python has no wheel on PyPI: we build it once into a wheelhouse outside the checkout,
# so fresh clones and CI on this machine install it in seconds. A fresh clone's `make run` to the
# first token, build included (tools/first_token.sh, shared 2-core box): 668 s, 606 CPU seconds
# (721 with libmtmd), before the common library was left out (docs/install.md: the wheel's build
# 387 -> 186 CPU seconds).
# Built for x86-64-v3 (AVX2/FMA/F16C) rather than -march=native: on CPUs with AMX (Sapphire
# Rapids) a native build of llama.cpp as bundled with 0.3.36 enables the AMX repack buffers and
# segfaults in the first llama_decode of Gemma 3 (Q4_K_M). Where /proc/cpuinfo shows AVX-512
# (F, CD, VL, DQ, BW) and no AMX the build adds it, with VNNI, VBMI and BF16 where present (AMX
# CPUs keep x86-64-v3: an AVX-512 build was never tried on one, the segfault was never pinned
# down to the AMX code alone, and a wrong guess would break every install there):
# llama.cpp's Q8_0 tinyBLAS kernel (Gemma's 262,144 x 640 output matrix) then has 32 vector
# registers and dpbusd. On an AMD EPYC (Zen 4) box, `python bench/build_isa.py` measured a
# 256-token prefill 1.4x and a 16-row decode pass 1.2x faster, one-row decode unchanged.
# Set LLAMA_CMAKE_ARGS to build otherwise (e.g. -DGGML_CUDA=on); each set of arguments gets its
# own wheelhouse (a hash of them), and a venv built with other arguments is reinstalled.
# LLAMA_SLIM_ARGS: what the wheel holds, only what the server loads. -DLLAVA_BUILD=OFF leaves out
# libmtmd (multimodal: clip, audio; llama_cpp loads it only for the LLaVA-style chat handlers,
# which the server never uses). llama.cpp's tools, examples, tests and server are already off in
# llama-cpp-python's build (llama.cpp is a subproject there); its common library, which
# llama-cpp-python's CMakeLists.txt forces on and its Python package never loads, is left out by
# tools/llama_no_common.cmake (see there). Kept apart from LLAMA_CMAKE_ARGS, which
# bench/setup_peers.sh reuses for llama.cpp's own llama-server. The wheelhouse's name hashes the
# arguments with that file's content, not its path, so every checkout shares one build.
LLAMA_CPP_VERSION := 0.3.36
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has_cpu = $(filter $(1),$(CPU_FLAGS))
AVX512 := $(if $(call has_cpu,amx_int8),,$(and $(call has_cpu,avx512f),$(call has_cpu,avx512cd),\
	$(call has_cpu,avx512vl),$(call has_cpu,avx512dq),$(call has_cpu,avx512bw)))
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON$(if $(AVX512), -DGGML_AVX512=ON$(if $(call has_cpu,avx512_vnni), \
	-DGGML_AVX512_VNNI=ON)$(if $(call has_cpu,avx512vbmi), -DGGML_AVX512_VBMI=ON)$(if \
	$(call has_cpu,avx512_bf16), -DGGML_AVX512_BF16=ON))
NO_COMMON := $(abspath tools/llama_no_common.cmake)
LLAMA_SLIM_ARGS := -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(NO_COMMON)
LLAMA_SLIM_ID := -DLLAVA_BUILD=OFF no-common:$(shell md5sum < $(NO_COMMON) | cut -c1-12)
LLAMA_BUILD_TAG := $(shell echo '$(LLAMA_CMAKE_ARGS) $(LLAMA_SLIM_ID)' | md5sum | cut -c1-12)
WHEELHOUSE ?= $(HOME)/.cache/llama-grpc/wheelhouse/$(LLAMA_BUILD_TAG)
LLAMA_BUILD := $(VENV)/.llama-cmake-args
# $(call build_llama_wheel,CMAKE ARGS,WHEELHOUSE): pip wheel -v, its output filtered to the
# [n/N] build steps and a line every 30 s (the whole output: WHEELHOUSE.log), so a first build
# (minutes) shows it is alive
build_llama_wheel = ls $(2)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || { \
	echo "building llama-cpp-python $(LLAMA_CPP_VERSION) once into $(2) (10+ minutes on 2 cores)"; \
	CMAKE_ARGS="$(1) $(LLAMA_SLIM_ARGS)" $(PY) tools/build_progress.py $(2).log -- \
	$(PY) -m pip wheel -v --no-deps --no-cache-dir --no-binary llama-cpp-python -w $(2) \
	llama-cpp-python==$(LLAMA_CPP_VERSION); }

# rewritten only when the arguments change, so the venv is reinstalled only then
$(LLAMA_BUILD): FORCE
	@mkdir -p $(VENV); echo '$(LLAMA_CMAKE_ARGS) $(LLAMA_SLIM_ID)' | cmp -s - $@ || \
		echo '$(LLAMA_CMAKE_ARGS) $(LLAMA_SLIM_ID)' > $@

$(STAMP): pyproject.toml $(LLAMA_BUILD)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=25.1"
	@$(call build_llama_wheel,$(LLAMA_CMAKE_ARGS),$(WHEELHOUSE))
	$(PY) -m pip install -q --find-links $(WHEELHOUSE) -e '.[server]' --group dev --group gateway
	$(PY) -m pip install -q --no-deps --force-reinstall \
		$(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	$(PY) -m llama_grpc_server.models.files --assemble
	touch $(STAMP)

# where this machine's llama-cpp-python wheel is, and the llama.cpp build arguments it was built
# with: bench/setup_peers.sh builds its peers the same way
wheelhouse:
	@echo $(WHEELHOUSE)

llama-cmake-args:
	@echo $(LLAMA_CMAKE_ARGS)

FORCE:

model: $(STAMP)
	$(PY) -m llama_grpc_server.models.files --assemble

# N replicas on free loopback ports behind Envoy on 127.0.0.1:$(PORT) (deploy/cluster.py).
REPLICAS ?= 3
cluster: $(STAMP)
	$(PY) -m deploy.cluster --replicas $(REPLICAS) --port $(PORT) -- $(ARGS)

# N replicas (default 2) behind the SMG gateway on 127.0.0.1:$(GATEWAY_PORT): the OpenAI API
# (chat, completions, responses, messages) for any OpenAI SDK, the vLLM engine protocol to the
# replicas (deploy/gateway.py), routed on the replicas' own KV events (SMG's cache_aware;
# GATEWAY_POLICY=round_robin or any SMG policy otherwise). SMG and the openai SDK come with the
# `gateway` group, which `make install` installs (the gateway's e2e tests need it).
GATEWAY_PORT ?= 8080
GATEWAY_POLICY ?= cache_aware
GATEWAY_REPLICAS := $(if $(filter command line environment,$(origin REPLICAS)),$(REPLICAS),2)

# SMG's tool-call and reasoning parsers are read off the model's chat template
# (deploy/smg_parsers.py); GATEWAY_TOOL_PARSER / GATEWAY_REASONING_PARSER override them ("none":
# SMG's own guess from the model id). A model whose tokenizer cannot be exported stops it at once.
GATEWAY_TOOL_PARSER ?=
GATEWAY_REASONING_PARSER ?=
# GATEWAY_LORAS="a b:0.5": the --lora adapters (in ARGS) also served as models MODEL+NAME, each
# by REPLICAS more replicas started with --engine-lora NAME[:SCALE] (the engine protocol has no
# LoRA field; docs/deployment.md)
GATEWAY_LORAS ?=

gateway: $(STAMP)
	$(PY) -m deploy.gateway --replicas $(GATEWAY_REPLICAS) --port $(GATEWAY_PORT) \
		--policy $(GATEWAY_POLICY) $(if $(GATEWAY_TOOL_PARSER),--tool-call-parser \
		$(GATEWAY_TOOL_PARSER)) $(if $(GATEWAY_REASONING_PARSER),--reasoning-parser \
		$(GATEWAY_REASONING_PARSER)) $(foreach lora,$(GATEWAY_LORAS),--engine-lora $(lora)) \
		-- $(MODEL_ARG) $(ARGS)

run: $(STAMP)
	$(BIN)/llama-grpc serve --host $(HOST) --port $(PORT) $(MODEL_ARG) $(ARGS)

serve: run

# llama.cpp's own test data (vocabulary GGUFs with their test vectors, real chat templates) from
# the pinned llama-cpp-python sdist, fetched once into ~/.cache/llama-grpc/llama.cpp-VERSION
# (testkit/llama_grpc_testkit/llama_sdist.py): the tokenizer tests and the synthetic model
# families use it.
test-data: $(STAMP)
	$(PY) -m llama_grpc_testkit.llama_sdist

# TEST_WORKERS=2 (the default, and CI's): two pytest processes (pytest-xdist), each module in
# one of them (--dist loadfile: its module-scoped servers start once), in collection order
# (--no-loadscope-reorder: end-to-end first, the many short unit tests last, so the workers
# finish together). Every test engine, server and replica runs llama.cpp on one thread
# (llama_grpc_testkit.threads.TEST_THREADS), so two workers fill two cores without spin-barrier
# fights
# (docs/install.md has the timings). Not --dist loadgroup: pytest-xdist 3.8 groups by a suffix it
# writes into item._nodeid, which pytest 9 no longer reads (Node.nodeid is str(self._id)), so
# every test was its own unit and a module's servers started in both workers.
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP) test-data
	$(PY) -m pytest tests --durations=15 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(ARGS)

test-unit: $(STAMP) test-data
	$(PY) -m pytest tests/unit $(ARGS)

test-model: $(STAMP) test-data
	$(PY) -m pytest tests/model $(ARGS)

test-e2e: $(STAMP) test-data
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

# docs/options.md from the option table (server/llama_grpc_server/config/options.py); a unit test
# fails when the committed page differs
docs: $(STAMP)
	$(PY) tools/options_doc.py

# Debian's prometheus (2.42), which tests/e2e/test_prometheus.py runs to scrape a server: CI
# (.ci/run, as root) installs it before `make check`. Nothing to do when it is on PATH; without
# root or apt-get it says so and the test skips, naming this target.
prometheus:
	@if command -v prometheus >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends prometheus >/dev/null && prometheus --version | head -1; \
	else echo "prometheus: not on PATH and cannot install it here (needs root and apt-get):" \
		"tests/e2e/test_prometheus.py will be skipped"; fi

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
# Envoy ring hash / round robin vs SMG cache_aware (KV events) / round robin vs one replica, on
# the multi-session chat and the shared-system-prompt workloads. A smoke run (results under its
# own name, not to be committed): ARGS="--reps 1 --sessions 3 --turns 2 --prompts 2 --users 4
# --concurrency 2 --max-tokens 4 --name cluster_smoke"
bench-cluster: $(BENCH_STAMP)
	$(PY) bench/cluster.py $(ARGS)
	$(PY) bench/summary.py
# One replica direct (v1) against the same replica through SMG (issue 31): tok/s, added TTFT, the
# gateway's CPU per token; not part of `make bench`. A smoke run (results under its own name):
# ARGS="--reps 1 --batches 1,8 --gen-tokens 16 --name gateway_smoke"
bench-gateway: $(BENCH_STAMP)
	$(PY) bench/gateway.py $(ARGS)
	$(PY) bench/summary.py
# Tool calling (issue 49): 47 BFCL-style cases (bench/tool_cases.json) on llama-grpc v1, the same
# replica through SMG and llama-server --jinja (bench/build_llama_server.sh builds it), greedy, on
# the trained Qwen2.5-Coder-0.5B-Instruct; rates per category, judged like BFCL's AST checker.
# Not part of `make bench`. A subset: ARGS="--model PATH --systems v1,llama-server --cases simple"
bench-tools: $(BENCH_STAMP)
	PYTHON=$(PYTHON) bench/build_llama_server.sh
	$(PY) bench/tools.py $(ARGS)
	$(PY) bench/summary.py
bench-kv-tiers: $(BENCH_STAMP)
	$(PY) bench/kv_tiers.py $(ARGS)
# Speculative decoding AUTO vs off (issue 17); a smoke run: ARGS="--reps 1 --gen-tokens 32 --batches 4"
bench-speculative: $(BENCH_STAMP)
	$(PY) bench/speculative.py $(ARGS)
	$(PY) bench/summary.py
# the x86-64-v3 (AVX2) wheel against the one `make install` built here; builds the first if missing
V3_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON
bench-build-isa: $(BENCH_STAMP)
	@v3=$$($(MAKE) -s --no-print-directory wheelhouse LLAMA_CMAKE_ARGS="$(V3_CMAKE_ARGS)"); \
	$(call build_llama_wheel,$(V3_CMAKE_ARGS),$$v3); \
	$(PY) bench/build_isa.py --baseline $$v3 --candidate $(WHEELHOUSE) $(ARGS)
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
# Soak: 64 streams with cancels and deadlines against a `llama-grpc serve` subprocess, with
# injected stalls (slow readers, a slow disk, an engine hang in a second replica at minute 3),
# 10 minutes by default (ARGS="--minutes 3" for less); not part of `make bench`. Fails if a check
# is missed.
bench-soak: $(BENCH_STAMP)
	$(PY) bench/soak.py $(ARGS)
	$(PY) bench/summary.py
# Back-pressure: three readers alone, beside a client that stopped reading (paused at
# --stream-buffer-tokens), and beside one on a server without back-pressure; ~5 minutes.
bench-backpressure: $(BENCH_STAMP)
	$(PY) bench/backpressure.py $(ARGS)
	$(PY) bench/summary.py
# A stream survives its replica (issue 52): SIGKILL of a replica under 12 resumed streams
# (tokens lost and repeated, the resumption's TTFT, without and with a shared disk tier) and the
# time to declare a hung engine (bench/resume_chaos.py); ~8 minutes, not part of `make bench`.
bench-resume-chaos: $(BENCH_STAMP)
	$(PY) bench/resume_chaos.py $(ARGS)
bench-embeddings: $(BENCH_STAMP)
	$(PY) bench/embeddings.py $(ARGS)
# LoRA adapters: 4 and 8 greedy streams on the trained Qwen2.5-Coder-0.5B-Instruct with no adapter,
# one, and 2 or 4 random rank-8 adapters interleaved; llama-grpc against llama-server with the same
# adapters (bench/build_llama_server.sh builds it), 1 thread each, 3 reps; ~40 minutes on 2 cores,
# not part of `make bench`. A check of the script (bench/results/lora_quick.*): ARGS="--quick"
bench-lora: $(BENCH_STAMP)
	PYTHON=$(PYTHON) bench/build_llama_server.sh
	$(PY) bench/lora.py $(ARGS)
bench-peers: $(BENCH_STAMP)
	PYTHON=$(PYTHON) bench/setup_peers.sh
	$(PY) bench/peers.py $(ARGS)
	$(PY) bench/summary.py

# aiperf (PyPI, its own venv bench/.venv-aiperf, no torch; with py-spy) against llama-grpc behind
# SMG, llama-server (bench/build_llama_server.sh: the pinned sdist's llama.cpp, our CPU flags)
# and the replica over v1 (issue 40); not part of `make bench`. A short run:
# ARGS="--threads 1 --lengths 512/64 --concurrency 4 --reps 2"
AIPERF_VENV := bench/.venv-aiperf
AIPERF_VERSION := 0.13.0
$(AIPERF_VENV)/.installed:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q "aiperf==$(AIPERF_VERSION)" "py-spy>=0.4"
	touch $@
bench-aiperf: $(BENCH_STAMP) $(AIPERF_VENV)/.installed
	PYTHON=$(PYTHON) bench/build_llama_server.sh
	$(PY) bench/aiperf.py $(ARGS)
	$(PY) bench/summary.py

# The GPU benchmark (issue 35), for a GPU machine that can fetch nothing: bench-gpu-bundle writes
# bench/gpu/carry (git-ignored: the device tool carries it), the slim llama.cpp 0.3.36 source and
# the wheels bench/gpu/requirements.txt names; there, `bench/gpu.sh OUTDIR` builds it for CUDA,
# makes random-weight Gemma 3 models and measures (bench/gpu_bench.py). bench-gpu-cpu runs the
# same script here end to end with a CPU build (the first build: 10+ minutes on 2 cores) and a
# tiny model: a test of the script, not a benchmark. Neither is part of `make check`.
bench-gpu-bundle:
	$(PYTHON) bench/gpu/make_bundle.py
GPU_CPU_OUT ?= bench/results/gpu_cpu_smoke
bench-gpu-cpu: bench-gpu-bundle
	PYTHON=$(PYTHON) bench/gpu.sh $(GPU_CPU_OUT) --cpu --shapes tiny --batches 1,2 --gen 8 --reps 1 \
		--deadline-s 1800 $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
