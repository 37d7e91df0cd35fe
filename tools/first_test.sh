#!/usr/bin/env bash
# The first half hour (issue 42): a fresh clone, an empty HOME (no llama-cpp-python wheel in the
# wheelhouse, an empty pip cache, no built test models), then `make test` as a new user runs it,
# timed in two parts: `make install` (the venv, the llama-cpp-python build, the pip installs)
# and the rest of `make test` (test data and the suite). Prints one JSON line: wall and CPU
# seconds (user + sys of everything make ran) of each part, the test summary line, and the load
# average at start and end (the machine may be shared: CPU seconds are the figure to compare).
#
#   tools/first_test.sh [REPO] [REF]          # default: this checkout, HEAD
#   TEST_WORKERS=0 tools/first_test.sh        # the suite in one process (default: make's)
#
# The clone and the temporary HOME are removed at the end (KEEP=1 keeps them); the make logs are
# copied to $LOG.install and $LOG.test (default LOG=/tmp/first_test.<ref>).
set -euo pipefail

repo=${1:-$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)}
ref=${2:-HEAD}
work=$(mktemp -d "${TMPDIR:-/tmp}/first-test.XXXXXX")
clone=$work/clone
fresh_home=$work/home
mkdir -p "$fresh_home"
log=${LOG:-/tmp/first_test.$(echo "$ref" | tr '/' '_')}
workers=()
if [ -n "${TEST_WORKERS:-}" ]; then workers=("TEST_WORKERS=$TEST_WORKERS"); fi

cleanup() {
	cp "$work/install.log" "$log.install" 2>/dev/null || true
	cp "$work/test.log" "$log.test" 2>/dev/null || true
	if [ "${KEEP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

git clone -q --no-local "$repo" "$clone"
git -C "$clone" checkout -q "$ref"
commit=$(git -C "$clone" rev-parse --short HEAD)

# one make in a fresh environment; prints "wall_s cpu_s rc" (CPU: the children it reaped)
timed_make() {
	local target=$1 out=$2
	local t0 t1 rc=0
	t0=$(date +%s.%N)
	(cd "$clone" && exec env -u PIP_CACHE_DIR -u XDG_CACHE_HOME -u VIRTUAL_ENV \
		HOME="$fresh_home" /usr/bin/time -f '%U %S' -o "$work/$target.cpu" \
		make "$target" "${workers[@]}" >"$out" 2>&1) || rc=$?
	t1=$(date +%s.%N)
	# the last line: GNU time writes "Command exited with non-zero status N" first on a failure
	tail -1 "$work/$target.cpu" |
		awk -v a="$t0" -v b="$t1" -v rc="$rc" '{ printf "%.1f %.1f %d\n", b - a, $1 + $2, rc }'
}

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
read -r install_wall install_cpu install_rc < <(timed_make install "$work/install.log")
if [ "$install_rc" != 0 ]; then
	echo "make install failed; the log's end:" >&2
	tail -30 "$work/install.log" >&2
	exit 1
fi
read -r test_wall test_cpu test_rc < <(timed_make test "$work/test.log")
load_end=$(cut -d' ' -f1-3 /proc/loadavg)
summary=$(grep -E '^=+ .*(passed|failed).* in ' "$work/test.log" | tail -1 || true)
built=$(grep -ci 'building wheel for llama-cpp-python\|building llama-cpp-python' \
	"$work/install.log" || true)

python3 - "$ref" "$commit" "$install_wall" "$install_cpu" "$test_wall" "$test_cpu" "$test_rc" \
	"$summary" "$load_start" "$load_end" "$built" "$(nproc)" "${TEST_WORKERS:-}" <<'EOF'
import json, sys
(ref, commit, iw, ic, tw, tc, rc, summary, load0, load1, built, cores, workers) = sys.argv[1:]
print(json.dumps({
    "ref": ref, "commit": commit, "cores": int(cores),
    "install_wall_s": float(iw), "install_cpu_s": float(ic),
    "test_wall_s": float(tw), "test_cpu_s": float(tc),
    "total_wall_s": round(float(iw) + float(tw), 1),
    "test_rc": int(rc), "summary": summary.strip("= "),
    "test_workers": workers or "make's default",
    "built_llama_cpp_python": built != "0",
    "loadavg_start": load0, "loadavg_end": load1,
}))
EOF
exit "$test_rc"
