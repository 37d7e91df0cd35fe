#!/usr/bin/env bash
# The whole GPU benchmark in one call, for a machine that can fetch nothing (issue 35):
#   1. unpack the slim llama.cpp 0.3.36 bundle (bench/gpu/make_bundle.py) and build it once,
#      CUDA for sm_90 (or, with --cpu, for this CPU), into shared libraries + llama-server +
#      llama-batched-bench + llama-quantize; a build left by an earlier call is reused
#   2. install the carried wheels (bench/gpu/requirements.txt) for whatever python3 is there,
#      into a folder on PYTHONPATH; llama-cpp-python's Python package comes from the bundle and
#      loads this build's libraries (LLAMA_CPP_LIB_PATH)
#   3. make the random-weight Gemma 3 models (llama_grpc_testkit.synth_gguf, quantized to
#      Q4_K_M by this build's llama-quantize)
#   4. bench/gpu_bench.py: raw loop, llama-grpc (overlap on/off) and llama-server at
#      B = 1..64, TTFT of a 512-token prompt, a py-spy profile: OUTDIR/gpu.json
# Everything is logged to OUTDIR/gpu_sh.log; any failure says which step failed and why.
#
#   bench/gpu.sh OUTDIR                         # on the GPU machine (device tool: see NOTES.md)
#   bench/gpu.sh OUTDIR --cpu --shapes tiny --batches 1,2 --gen 8 --reps 1   # a test run here
#
# Options: --cpu, --shapes LIST (270m,1b), --batches LIST, --gen N, --reps N, --deadline-s S
# (the whole script, default 570: a device call is cut at 600), --no-profile.
set -euo pipefail

OUTDIR=${1:?usage: bench/gpu.sh OUTDIR [--cpu] [--shapes 270m,1b] [--batches ...] [--gen N] [--reps N]}
shift
MODE=cuda SHAPES=270m,1b BATCHES=1,4,8,16,32,64 GEN=64 REPS=3 DEADLINE_S=570 PROFILE=--profile
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) MODE=cpu ;;
        --shapes) SHAPES=$2; shift ;;
        --batches) BATCHES=$2; shift ;;
        --gen) GEN=$2; shift ;;
        --reps) REPS=$2; shift ;;
        --deadline-s) DEADLINE_S=$2; shift ;;
        --no-profile) PROFILE= ;;
        *) echo "gpu.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$REPO/bench/gpu/carry
BUNDLE=$CARRY/llama-cpp-0.3.36-slim.tar.xz
# kept between calls on a warm machine (git-ignored, never carried)
WORK=${GPU_BENCH_WORK:-$REPO/bench/gpu/work}
PY=${PYTHON:-python3}
T0=$(date +%s)
mkdir -p "$OUTDIR" "$WORK"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG=$OUTDIR/gpu_sh.log
STEP=start

log() { echo "[gpu.sh $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG" >&2; }
fail() { log "FAILED in step '$STEP': $*"; exit 1; }
on_exit() {
    local rc=$?
    [ "$rc" -eq 0 ] || log "exit $rc in step $STEP (see above and $LOG)"
}
trap on_exit EXIT
step() { STEP=$1; log "== $1"; }

step facts
{
    echo "mode: $MODE"; uname -a; nproc
    "$PY" --version 2>&1
    cmake --version 2>&1 | head -1 || true
    nvcc --version 2>&1 | tail -2 || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
} | tee -a "$LOG" >&2
[ -f "$BUNDLE" ] || fail "no $BUNDLE: run python bench/gpu/make_bundle.py here and carry bench/gpu/carry"

step unpack
SRC=$WORK/src
stamp=$(cksum < "$BUNDLE" | cut -d' ' -f1)
if [ "$(cat "$SRC/.bundle" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    tar -xf "$BUNDLE" -C "$SRC" || "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BUNDLE" "$SRC" \
        || fail "cannot unpack $BUNDLE"
    echo "$stamp" > "$SRC/.bundle"
fi

step python
SITE=$WORK/site-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$(cat "$SITE/.requirements" 2>/dev/null)" != "$(cksum < "$REPO/bench/gpu/requirements.txt")" ]; then
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        --find-links "$CARRY/wheels" -r "$REPO/bench/gpu/requirements.txt" >> "$LOG" 2>&1 \
        || { tail -20 "$LOG" >&2; fail "pip could not install bench/gpu/requirements.txt from the carried wheels for $("$PY" --version 2>&1) (a wheel for this Python missing? see $LOG)"; }
    cksum < "$REPO/bench/gpu/requirements.txt" > "$SITE/.requirements"
fi
export PYTHONPATH=$SITE:$SRC:$REPO/client:$REPO/server:$REPO/testkit:$REPO/bench${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1

step models-f16
# the f16 files are written while llama.cpp builds (one core); llama-quantize runs after it
MODELS=() PENDING=()
mkdir -p "$WORK/models"
for shape in ${SHAPES//,/ }; do
    q=$WORK/models/synth-$shape-q4_k_m.gguf
    MODELS+=(--model "$shape=$q")
    [ -s "$q" ] && continue
    f16=$WORK/models/synth-$shape-f16.gguf
    "$PY" -m llama_grpc_testkit.synth_gguf --shape "$shape" --out "$f16" >> "$LOG" 2>&1 &
    PENDING+=("$shape:$!")
done

step build
BUILD=$WORK/build-$MODE
COMMON=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if [ "$MODE" = cuda ]; then
    command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
    command -v nvcc >/dev/null || fail "no nvcc on PATH or in /usr/local/cuda/bin"
    # one architecture (H100/H200), machine code only: no PTX for the driver to compile; one
    # GPU, so no NCCL
    COMMON+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_NCCL=OFF
        "-DCMAKE_CUDA_COMPILER=$(command -v nvcc)")
fi
GEN_ARGS=()
command -v ninja >/dev/null && GEN_ARGS=(-G Ninja)
configure() {
    cmake -S "$SRC/llama.cpp" -B "$BUILD" ${GEN_ARGS[@]+"${GEN_ARGS[@]}"} "${COMMON[@]}" "$@" \
        >> "$LOG" 2>&1
}
# cuBLAS where CMake does not look: the pip wheels PyTorch depends on (nvidia-cublas)
pip_cublas() {
    local sites hdr lib lt
    sites=$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) || return 1
    # shellcheck disable=SC2086
    hdr=$(find $sites -maxdepth 5 -name cublas_v2.h 2>/dev/null | head -1)
    # shellcheck disable=SC2086
    lib=$(find $sites -maxdepth 5 -name 'libcublas.so*' 2>/dev/null | head -1)
    # shellcheck disable=SC2086
    lt=$(find $sites -maxdepth 5 -name 'libcublasLt.so*' 2>/dev/null | head -1)
    [ -n "$hdr" ] && [ -n "$lib" ] && [ -n "$lt" ] || return 1
    log "cuBLAS from pip: $hdr $lib"
    LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
    CUBLAS=("-DCUDA_cublas_LIBRARY=$lib" "-DCUDA_cublasLt_LIBRARY=$lt"
        "-DCMAKE_CUDA_FLAGS=-I$(dirname "$hdr")" "-DCMAKE_CXX_FLAGS=-I$(dirname "$hdr")")
}
CUBLAS=()
if [ -f "$BUILD/.cublas" ]; then  # an earlier call configured with pip's cuBLAS
    pip_cublas || true
elif [ ! -f "$BUILD/CMakeCache.txt" ]; then
    if ! configure; then
        if ! { [ "$MODE" = cuda ] && grep -qi cublas "$LOG" && pip_cublas; }; then
            tail -30 "$LOG" >&2
            fail "cmake configure (see $LOG)"
        fi
        rm -rf "$BUILD"
        configure "${CUBLAS[@]}" || { tail -30 "$LOG" >&2; fail "cmake configure with pip's cuBLAS (see $LOG)"; }
        touch "$BUILD/.cublas"
    fi
fi
JOBS=${GPU_BENCH_JOBS:-$(nproc)}
nice -n 5 cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-batched-bench llama-quantize \
    >> "$LOG" 2>&1 || { tail -40 "$LOG" >&2; fail "cmake build (see $LOG)"; }
BIN=$BUILD/bin
ls "$BIN"/libllama.so "$BIN"/llama-server "$BIN"/llama-batched-bench "$BIN"/llama-quantize >/dev/null \
    || fail "the build left no libllama.so / llama-server / llama-batched-bench / llama-quantize in $BIN"
log "build ready in $BIN"

step imports
# llama_cpp._ggml (the device queries of --n-gpu-layers auto) looks in the package's lib/ only
ln -sfn "$BIN" "$SRC/llama_cpp/lib"
export LLAMA_CPP_LIB_PATH=$BIN
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG" >&2 || fail "a Python module is missing or too old (above)"
import importlib, sys
need = ["numpy", "yaml", "jinja2", "typing_extensions", "tqdm", "diskcache", "grpc",
        "google.protobuf", "grpc_status", "grpc_health.v1", "grpc_reflection.v1alpha",
        "structlog", "prometheus_client", "gguf", "llama_cpp", "llama_grpc", "llama_grpc_server"]
missing = []
for name in need:
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')} {getattr(module, '__file__', '')}")
    except Exception as exc:
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("missing: " + "; ".join(missing))
    sys.exit(1)
import llama_cpp
print("  llama.cpp system info:", llama_cpp.llama_print_system_info().decode())
print("  gpu offload:", bool(llama_cpp.llama_supports_gpu_offload()))
EOF

step models
for job in ${PENDING[@]+"${PENDING[@]}"}; do
    shape=${job%%:*}
    wait "${job#*:}" || fail "writing the $shape model (see $LOG)"
    f16=$WORK/models/synth-$shape-f16.gguf q=$WORK/models/synth-$shape-q4_k_m.gguf
    "$BIN/llama-quantize" "$f16" "$q.tmp" Q4_K_M >> "$LOG" 2>&1 || fail "llama-quantize $shape (see $LOG)"
    mv "$q.tmp" "$q" && rm -f "$f16"
    log "$shape: $(du -h "$q" | cut -f1) Q4_K_M"
done

step bench
if [ "$MODE" = cuda ]; then NGL=(--ngl -1 --ngl-peer 999); else NGL=(--ngl 0 --ngl-peer 0); fi
LEFT=$(( DEADLINE_S - ($(date +%s) - T0) ))
[ "$LEFT" -gt 60 ] || fail "only ${LEFT}s left for the benchmark (the build or the models took the time): run again, the build is kept"
cd "$REPO"
"$PY" bench/gpu_bench.py "${MODELS[@]}" --llama-server "$BIN/llama-server" \
    --batched-bench "$BIN/llama-batched-bench" --out "$OUTDIR/gpu.json" --batches "$BATCHES" \
    --gen "$GEN" --reps "$REPS" --deadline-s "$(( LEFT - 15 ))" "${NGL[@]}" $PROFILE 2>&1 \
    | tee -a "$LOG" >&2 || fail "gpu_bench.py failed (what it measured is in $OUTDIR/gpu.json)"
STEP=finished
log "done: $OUTDIR/gpu.json"
