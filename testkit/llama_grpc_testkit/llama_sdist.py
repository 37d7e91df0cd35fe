"""llama.cpp's own test data, from the pinned llama-cpp-python sdist on the package index.

The sdist of the llama-cpp-python version the project pins carries llama.cpp's tokenizer test
files and real models' chat templates (`vendor/llama.cpp/models/`):

- `ggml-vocab-NAME.gguf`: vocabulary-only GGUFs (tokenizer keys, no tensors), 19 of them;
- `ggml-vocab-NAME.gguf.inp` / `.out`: llama.cpp's test-tokenizer-0 vectors for most of them
  (texts separated by the line `__ggml_vocab_test__`; the ids for add_special = false,
  parse_special = false, one line of space-separated ids per text);
- `templates/*.jinja`: chat templates of real models (Qwen, Llama 3.x, DeepSeek, Mistral,
  gpt-oss, Gemma, Phi, ...).

`ensure()` downloads the sdist once (pip, no dependencies, ~77 MB), keeps only those files
under `~/.cache/llama-grpc/llama.cpp-<version>/` (beside the wheelhouse; ~40 MB) and returns that
folder; later calls only check it. The synthetic model generator (`synth_gguf.py`) takes its
vocabularies and templates from here, and the tests take their vectors.

    python -m llama_grpc_testkit.llama_sdist       # fetch if missing, print the folder
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # the llama-cpp-python the Makefile pins (LLAMA_CPP_VERSION)
_MEMBER_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
_DONE = ".complete"
SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llama-grpc" / f"llama.cpp-{VERSION}"


def _wanted(name: str) -> bool:
    if not name.startswith(_MEMBER_ROOT):
        return False
    rest = name[len(_MEMBER_ROOT) :]
    if rest.startswith("templates/"):
        return rest.endswith(".jinja") and "/" not in rest[len("templates/") :]
    return rest.startswith("ggml-vocab-") and "/" not in rest


def ensure(root: Path | None = None) -> Path:
    """The folder holding `models/ggml-vocab-*` and `models/templates/*.jinja`, fetched from the
    package index the first time (atomically: a half-made folder is never used)."""
    root = root or cache_root()
    if (root / _DONE).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".sdist-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--dest", tmp, f"llama-cpp-python=={VERSION}"],
            check=True,
        )  # fmt: skip
        (archive,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        staged = Path(tmp) / "staged"
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and _wanted(member.name):
                    rel = member.name[len(_MEMBER_ROOT) :]
                    out = staged / "models" / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(member)
                    assert source is not None
                    out.write_bytes(source.read())
        (staged / _DONE).write_text(f"llama-cpp-python {VERSION}\n")
        if root.exists():
            shutil.rmtree(root)
        staged.rename(root)
    return root


@dataclass(frozen=True)
class Vectors:
    texts: list[str]
    ids: list[list[int]]


def vocab_path(name: str, root: Path | None = None) -> Path:
    """models/ggml-vocab-NAME.gguf (NAME as in the file name: llama-bpe, qwen2, gemma-4, ...)."""
    return ensure(root) / "models" / f"ggml-vocab-{name}.gguf"


def vocab_names(root: Path | None = None) -> list[str]:
    folder = ensure(root) / "models"
    files = folder.glob("ggml-vocab-*.gguf")
    return sorted(p.name[len("ggml-vocab-") : -len(".gguf")] for p in files)


def vectors(name: str, root: Path | None = None) -> Vectors | None:
    """llama.cpp's test-tokenizer-0 vectors for vocabulary NAME (None where it has none), read
    as tests/test-tokenizer-0.cpp reads them."""
    base = vocab_path(name, root)
    inp, out = base.with_name(base.name + ".inp"), base.with_name(base.name + ".out")
    if not (inp.is_file() and out.is_file()):
        return None
    raw = inp.read_bytes().decode("utf-8")  # bytes: no newline translation (\r\n stays)
    texts, pos = [], 0
    while pos < len(raw):  # test-tokenizer-0.cpp's loop: no empty text after the last separator
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = out.read_bytes().decode("utf-8").splitlines()
    ids = [[int(t) for t in line.split()] for line in lines]
    if len(texts) != len(ids):
        raise ValueError(f"{inp.name}: {len(texts)} texts but {len(ids)} id lines")
    return Vectors(texts, ids)


def template(name: str, root: Path | None = None) -> str:
    """models/templates/NAME.jinja's text (NAME without .jinja)."""
    return (ensure(root) / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def template_names(root: Path | None = None) -> list[str]:
    return sorted(p.stem for p in (ensure(root) / "models" / "templates").glob("*.jinja"))


if __name__ == "__main__":
    print(ensure())
