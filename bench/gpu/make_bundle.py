"""Make what bench/gpu.sh needs on a GPU machine that can fetch nothing, small enough to travel
(the device tool carries at most 64 MiB with the working tree):

  bench/gpu/carry/llama-cpp-0.3.36-slim.tar.xz   llama.cpp as vendored in the pinned
      llama-cpp-python 0.3.36 sdist, cut to what a build of libllama/libggml (CUDA or CPU),
      llama-server, llama-batched-bench and llama-quantize needs, plus the sdist's `llama_cpp`
      Python package (it loads the libraries of that build through LLAMA_CPP_LIB_PATH)
  bench/gpu/carry/wheels/   the Python wheels llama-grpc and llama_grpc_testkit.synth_gguf need
      beyond what the GPU image has, for CPython 3.10-3.13 (bench/gpu/requirements.txt)

bench/gpu/carry/ is git-ignored: name it in the device tool's `carry`.

    python bench/gpu/make_bundle.py            # sdist from pip's download, into the cache
    python bench/gpu/make_bundle.py --no-wheels --sdist PATH

The source is cut by a deny list (docs, models, tests, examples, other backends, the web UI's
sources...) and tools/CMakeLists.txt is rewritten to add only the tools we build. A CPU build of
the cut tree (bench/gpu.sh --cpu) is what proves nothing needed was cut."""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / "bench" / "gpu" / "carry"
VERSION = "0.3.36"
BUNDLE = f"llama-cpp-{VERSION}-slim.tar.xz"
SDIST_CACHE = Path.home() / ".cache" / "llama-grpc" / "sdist"
REQUIREMENTS = ROOT / "bench" / "gpu" / "requirements.txt"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

# paths under vendor/llama.cpp left out (prefix match on whole path components)
DROP = (
    ".devops",
    ".github",
    "AUTHORS",
    "app",
    "benches",
    "ci",
    "conversion",
    "docs",
    "examples",
    "gguf-py",
    "grammars",
    "media",
    "models",
    "pocs",
    "requirements",
    "skills",
    "tests",
    # other backends (each is added only when its GGML_<NAME> option is on)
    *(
        f"ggml/src/ggml-{b}"
        for b in (
            "cann",
            "et",
            "hexagon",
            "hip",
            "metal",
            "musa",
            "opencl",
            "openvino",
            "sycl",
            "virtgpu",
            "vulkan",
            "webgpu",
            "zdnn",
            "zendnn",
        )
    ),
    # CPU code for other architectures: both machines are x86-64
    *(
        f"ggml/src/ggml-cpu/{d}"
        for d in (
            "arch/arm",
            "arch/loongarch",
            "arch/powerpc",
            "arch/riscv",
            "arch/s390",
            "arch/wasm",
            "kleidiai",
            "spacemit",
        )
    ),
    # the web UI's sources: with LLAMA_BUILD_UI and LLAMA_USE_PREBUILT_UI off the server gets
    # an empty UI, built from ui.cpp.in / ui.h.in alone
    "tools/ui/src",
    "tools/ui/tests",
    "tools/ui/static",
    "tools/ui/package-lock.json",
    "tools/server/tests",
    "tools/server/public",
    "tools/mtmd/tests",
    "tools/mtmd/test-1.jpeg",
    "tools/mtmd/test-2.mp3",
    "tools/mtmd/test-3.mp4",
)
TOOLS = ("batched-bench", "quantize", "ui", "server", "mtmd")
KEEP_SCRIPTS = ("scripts/ui-assets.cmake", "scripts/build-info.sh")
TOOLS_CMAKE = (
    "# bench/gpu/make_bundle.py: only the tools bench/gpu.sh builds (and what they link)\n"
    "find_package(Threads REQUIRED)\n"
    "llama_add_compile_flags()\n" + "".join(f"add_subdirectory({t})\n" for t in TOOLS)
)


def dropped(rel: str) -> bool:
    if rel.startswith("scripts/"):
        return rel not in KEEP_SCRIPTS
    if rel.startswith("tools/"):
        parts = rel.split("/")
        if len(parts) > 2 and parts[1] not in TOOLS:
            return True
        if len(parts) == 2 and parts[1] not in TOOLS and parts[1] != "CMakeLists.txt":
            return True
    return any(rel == d or rel.startswith(d + "/") for d in DROP)


def sdist_path(given: str | None) -> Path:
    if given:
        return Path(given)
    path = SDIST_CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if not path.exists():
        SDIST_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", str(SDIST_CACHE), f"llama-cpp-python=={VERSION}"],
            check=True,
        )  # fmt: skip
    return path


def make_bundle(sdist: Path, out: Path) -> tuple[int, int, int]:
    """Write the slim tarball; return (files kept, their bytes, files dropped)."""
    prefix = f"llama_cpp_python-{VERSION}/"
    vendor = prefix + "vendor/llama.cpp/"
    package = prefix + "llama_cpp/"
    kept = size = skipped = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:xz", preset=6) as dst:
        for member in src:
            if member.name.startswith(vendor):
                rel = member.name[len(vendor) :]
                if not rel or dropped(rel):
                    skipped += member.isfile()
                    continue
                name = "llama.cpp/" + rel
            elif member.name.startswith(package):
                name = "llama_cpp/" + member.name[len(package) :]
            else:
                continue
            if not (member.isfile() or member.isdir()):
                continue  # there are none in the parts we keep
            member.name = name
            member.pax_headers = {}  # a long name's pax "path" would override the new one
            if member.isfile():
                data = src.extractfile(member)
                assert data is not None
                if name == "llama.cpp/tools/CMakeLists.txt":
                    body = TOOLS_CMAKE.encode()
                    member.size = len(body)
                    data = io.BytesIO(body)  # type: ignore[assignment]
                dst.addfile(member, data)
                kept += 1
                size += member.size
            else:
                dst.addfile(member)
    tmp.replace(out)
    return kept, size, skipped


def requirements() -> list[str]:
    lines = REQUIREMENTS.read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def download_wheels(dest: Path) -> None:
    """Binary wheels of bench/gpu/requirements.txt (each pinned, with its dependencies) for every
    Python in PYTHONS; pure-Python ones once."""
    dest.mkdir(parents=True, exist_ok=True)
    for python in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", str(dest)]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run([*cmd, *requirements()], check=True)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", help="llama_cpp_python-0.3.36.tar.gz (default: pip download)")
    parser.add_argument("--out", default=str(CARRY))
    parser.add_argument("--no-wheels", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    sdist = sdist_path(args.sdist)
    kept, size, skipped = make_bundle(sdist, out / BUNDLE)
    packed = (out / BUNDLE).stat().st_size
    print(
        f"bundle: {out / BUNDLE}: {kept} files, {size / 2**20:.1f} MiB unpacked, "
        f"{packed / 2**20:.1f} MiB packed ({skipped} files of the sdist's tree left out)"
    )
    if not args.no_wheels:
        download_wheels(out / "wheels")
        wheels = out / "wheels"
        print(f"wheels: {len(list(wheels.glob('*.whl')))} in {wheels}, "
              f"{tree_bytes(wheels) / 2**20:.1f} MiB")  # fmt: skip
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = [ROOT / f.decode() for f in tracked if f]
    tree = sum(p.stat().st_size for p in paths if p.is_file())
    total = tree + tree_bytes(out)
    print(f"travels: working tree {tree / 2**20:.1f} MiB + carry {tree_bytes(out) / 2**20:.1f} MiB"
          f" = {total / 2**20:.1f} MiB (limit 64 MiB)")  # fmt: skip
    if total > 64 * 2**20:
        print("over the device tool's 64 MiB: carry less", file=sys.stderr)
        return 1
    shutil.rmtree(out / "__pycache__", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
