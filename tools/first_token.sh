#!/usr/bin/env bash
# The first ten minutes (issue 32): a fresh clone, an empty HOME (no llama-cpp-python wheel in the
# wheelhouse, an empty pip cache), `make run`, and a client polling until the first streamed
# token. Prints one JSON line: wall seconds to the installed venv and to the first token, the CPU
# seconds (user + sys) of everything `make` ran before the server (the install: venv, the
# llama-cpp-python build, pip installs, the model), and the load average at start and end (the
# machine may be shared: CPU seconds are the figure to compare).
#
#   tools/first_token.sh [REPO] [REF]    # default: this checkout, HEAD
#   tools/first_token.sh /work/main main
#
# The clone and the temporary HOME are removed at the end (KEEP=1 keeps them); the make log is
# copied to $LOG (default /tmp/first_token.<ref>.log).
set -euo pipefail

repo=${1:-$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)}
ref=${2:-HEAD}
deadline_s=${DEADLINE_S:-3600}
work=$(mktemp -d "${TMPDIR:-/tmp}/first-token.XXXXXX")
clone=$work/clone
fresh_home=$work/home
mkdir -p "$fresh_home"
log=${LOG:-/tmp/first_token.$(echo "$ref" | tr '/' '_').log}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

git clone -q --no-local "$repo" "$clone"
git -C "$clone" checkout -q "$ref"
commit=$(git -C "$clone" rev-parse --short HEAD)

make_pid=
cleanup() {
	if [ -n "$make_pid" ]; then kill -TERM -- "-$make_pid" 2>/dev/null || true; fi
	wait 2>/dev/null || true
	cp "$work/make.log" "$log" 2>/dev/null || true
	if [ "${KEEP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s.%N)
# its own process group (set -m), so the server and everything make started end with it
set -m
(cd "$clone" && exec env -u PIP_CACHE_DIR -u XDG_CACHE_HOME -u VIRTUAL_ENV HOME="$fresh_home" \
	make run PORT="$port" >"$work/make.log" 2>&1) &
make_pid=$!
set +m

# CPU seconds (user + sys) of the children make has reaped: the install recipe's commands, not
# the server, which is still running
reaped_cpu() {
	awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); print ($14 + $15) / hz }' \
		"/proc/$make_pid/stat"
}

installed=
while :; do
	now=$(date +%s.%N)
	if ! kill -0 "$make_pid" 2>/dev/null; then
		echo "make exited before the first token; the log's end:" >&2
		tail -30 "$work/make.log" >&2
		exit 1
	fi
	if awk -v a="$now" -v b="$start" -v d="$deadline_s" 'BEGIN { exit !(a - b > d) }'; then
		echo "no first token after ${deadline_s}s" >&2
		exit 1
	fi
	if [ -z "$installed" ] && [ -e "$clone/.venv/.installed" ]; then
		installed=$now
		install_cpu=$(reaped_cpu)
	fi
	if [ -n "$installed" ] && HOME="$fresh_home" "$clone/.venv/bin/llama-grpc" stream "Hello" \
		--max-tokens 1 --temperature 0 --timeout 20 --target "127.0.0.1:$port" >/dev/null 2>&1; then
		break
	fi
	sleep 1
done
end=$(date +%s.%N)
load_end=$(cut -d' ' -f1-3 /proc/loadavg)
built=$(grep -ci 'building wheel for llama-cpp-python\|building llama-cpp-python' "$work/make.log" || true)

python3 - "$ref" "$commit" "$start" "$installed" "$end" "$install_cpu" "$load_start" \
	"$load_end" "$built" "$(nproc)" <<'EOF'
import json, sys
ref, commit, start, installed, end, cpu, load0, load1, built, cores = sys.argv[1:]
print(json.dumps({
    "ref": ref, "commit": commit, "cores": int(cores),
    "install_wall_s": round(float(installed) - float(start), 1),
    "first_token_wall_s": round(float(end) - float(start), 1),
    "install_cpu_s": round(float(cpu), 1),
    "built_llama_cpp_python": built != "0",
    "loadavg_start": load0, "loadavg_end": load1,
}))
EOF
