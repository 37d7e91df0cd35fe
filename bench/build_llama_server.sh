#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU) from the llama.cpp vendored in the pinned llama-cpp-python
# sdist: the same llama.cpp commit our server runs, with our wheel's CPU flags
# (`make llama-cmake-args`), as bench/gpu.sh --cpu does, but only the llama-server target.
#
#   bench/build_llama_server.sh      # ~15-25 min on 2 shared cores (nice 10, -j 2)
#
# Result: ~/.cache/llama-grpc/llama-server-cpu/llama-server (linked statically: no shared
# libraries to carry), and READY holding its path once `llama-server --version` runs.
# bench/peers.py's llama_server_binary() takes it from READY (no env var needed).
# Idempotent: a READY whose flags match is left alone; another set of flags rebuilds.
set -euo pipefail

VERSION=0.3.36
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/llama-grpc
OUT=${LLAMA_SERVER_CPU_DIR:-$CACHE/llama-server-cpu}
SDIST_DIR=$CACHE/sdist
SDIST=$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz
SRC=$OUT/src
BUILD=$OUT/build
PYTHON=${PYTHON:-python3}
JOBS=${LLAMA_SERVER_JOBS:-2}

FLAGS="$(make -s --no-print-directory -C "$REPO" llama-cmake-args)"
ARGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_CURL=OFF)
# shellcheck disable=SC2206
ARGS+=($FLAGS)
STAMP="llama-cpp-python $VERSION sdist; ${ARGS[*]}"

if [ -f "$OUT/READY" ] && [ -f "$OUT/.flags" ] && [ "$(cat "$OUT/.flags")" = "$STAMP" ] \
    && "$(cat "$OUT/READY")" --version >/dev/null 2>&1; then
    echo "llama-server: already built: $(cat "$OUT/READY")"
    exit 0
fi
rm -f "$OUT/READY"
mkdir -p "$OUT" "$SDIST_DIR"

if [ ! -s "$SDIST" ]; then
    echo "llama-server: fetching the llama-cpp-python $VERSION sdist into $SDIST_DIR"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$SDIST_DIR" \
        "llama-cpp-python==$VERSION"
fi
if [ ! -f "$SRC/.complete" ]; then
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    touch "$SRC/.complete"
fi

if [ ! -f "$BUILD/CMakeCache.txt" ] || [ "$(cat "$BUILD/.flags" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$BUILD"
    GEN=()
    command -v ninja >/dev/null && GEN=(-G Ninja)
    cmake -S "$SRC" -B "$BUILD" ${GEN[@]+"${GEN[@]}"} "${ARGS[@]}" > "$OUT/configure.log" 2>&1 \
        || { tail -30 "$OUT/configure.log" >&2; exit 1; }
    echo "$STAMP" > "$BUILD/.flags"
fi
echo "llama-server: building (nice 10, -j $JOBS; log: $OUT/build.log)"
nice -n 10 cmake --build "$BUILD" -j "$JOBS" --target llama-server > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log" >&2; exit 1; }
install -m 755 "$BUILD/bin/llama-server" "$OUT/llama-server"
# a static build needs no libllama/libggml; any shared one it still names is copied beside it
for lib in $(ldd "$OUT/llama-server" | awk '/=> \// && $3 ~ /lib(llama|ggml|mtmd)/ {print $3}'); do
    install -m 644 "$lib" "$OUT/"
done
"$OUT/llama-server" --version
echo "$STAMP" > "$OUT/.flags"
echo "$OUT/llama-server" > "$OUT/READY"
echo "llama-server: ready: $OUT/llama-server"
