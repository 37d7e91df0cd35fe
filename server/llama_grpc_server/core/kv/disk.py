"""The KV disk tier: saved sequence states (llama.cpp's llama_state_seq_get_data blobs) in files
of our own format under --kv-cache-dir, found by longest token prefix, verified before use,
written atomically, shared safely by several processes.

llama.cpp's own slot files store no model identity and never check the tokens, so a restore can
"succeed" into the wrong model or history. Here every file says what produced it and what it
holds, and nothing is trusted that does not check out:

    b"LGKV" | u32 format version | u32 header length | u32 crc32(header) | header (JSON)
    | token ids (int32 LE) | blob

The header names the engine fingerprint (model sha256, n_ctx, KV types, flash attention, SWA,
llama-cpp-python version: anything that changes what a blob means), the cache scope, the token
count and the crc32 of the tokens and of the blob. A file is written to a unique temporary name
and renamed into place (atomic on POSIX), so no reader ever sees half a file; its name is
`<fingerprint tag>-<hash of scope + tokens>.lgkv`, so two replicas saving the same history write
the same name and either copy is right. A file that is truncated, corrupt, or claims our
fingerprint without matching it is skipped with one warning and deleted. Files of another
fingerprint (another model or configuration sharing the directory) are left alone: they are not
ours to judge, and they age out through the shared byte budget like any other file.

Lookup is by longest token prefix: token blocks of BLOCK_TOKENS, hashed in a chain seeded with
the scope, map to the files that start with them; the deepest matching block picks candidates,
whose exact common prefix is then computed from their token ids. The index is rebuilt from the
headers at start (they are small: 4 bytes a token) and refreshed when the directory changes (a
file written by another replica). One scope can never reach another's file: the scope seeds the
chain and is checked again at load.

The engine thread calls lookup (the index in memory: no file is touched) and clear. Nothing it
does waits for the disk: a reader thread reads and verifies the file a restore needs (read(),
whose answer comes back through a callback) and refreshes the index every REFRESH_S, and a
writer thread does every write and eviction. So a volume that blocks delays the requests waiting
for its bytes and no tick. One lock guards the index between the three; no file operation runs
with it held."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from llama_grpc_server.core.api import DiskTierStats
from llama_grpc_server.core.kv.prefix_cache import common_prefix_length

log = structlog.get_logger("llama_grpc.kv_disk")

MAGIC = b"LGKV"
FORMAT_VERSION = 1
SUFFIX = ".lgkv"
BLOCK_TOKENS = 64
"""Prefix blocks: a file is found through its first full blocks (shorter caches are not worth a
file: the RAM tier's minimum is 64 tokens too)."""
STALE_TEMP_S = 600.0
"""A temporary file older than this is a crashed writer's (a live one renames within seconds)."""
MAX_CANDIDATES = 8
"""Files compared token by token at the deepest matching block (the most recently used)."""
REFRESH_S = 1.0
"""The reader thread looks for files other replicas wrote (a stat of the directory) this often."""
MAX_PENDING_READS = 64
"""Reads queued for the reader thread at most; read() refuses more (the request computes)."""

_PREFIX = struct.Struct("<4sIII")


Loaded = tuple[list[int], bytes]  # a saved state: its tokens and llama.cpp's blob
ReadDone = Callable[[Loaded | None], None]
"""What a read() calls on the reader thread with the verified (tokens, state), or None."""


def _no_read(loaded: tuple[list[int], bytes] | None) -> None:
    """The reader thread's turn without a read (time for the index refresh)."""


class CorruptFile(ValueError):
    """A file that must not be used: why, in one line."""


@dataclass(slots=True)
class _Entry:
    name: str
    scope: str
    tokens: array[int]
    size: int
    blob_offset: int
    blob_bytes: int
    blob_crc: int
    chain: list[bytes] = field(default_factory=list)  # one hash per full token block


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0
    evictions: int = 0
    verify_failures: int = 0
    read_seconds: float = 0.0
    read_bytes: int = 0
    read_failures: int = 0


def fingerprint_tag(fingerprint: Mapping[str, object]) -> str:
    """16 hex digits naming a fingerprint in file names."""
    text = json.dumps(dict(fingerprint), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _chain_seed(scope: str) -> bytes:
    return hashlib.blake2b(b"lgkv-scope\0" + scope.encode(), digest_size=16).digest()


def iter_chain(scope: str, tokens: Sequence[int]) -> Iterator[bytes]:
    """The chained hash of each full block of `tokens` (seeded with the scope), lazily: a
    lookup stops at the first block no file has."""
    h = _chain_seed(scope)
    for i in range(len(tokens) // BLOCK_TOKENS):
        block = array("i", tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        yield h


def block_chain(scope: str, tokens: Sequence[int]) -> list[bytes]:
    """Every block's chained hash (what a file is indexed under)."""
    return list(iter_chain(scope, tokens))


def encode(
    fingerprint: Mapping[str, object], scope: str, tokens: Sequence[int], blob: bytes
) -> bytes:
    """One file's bytes."""
    token_bytes = array("i", tokens).tobytes()
    header = json.dumps(
        {
            "fingerprint": dict(fingerprint),
            "scope": scope,
            "n_tokens": len(tokens),
            "tokens_crc32": zlib.crc32(token_bytes),
            "blob_bytes": len(blob),
            "blob_crc32": zlib.crc32(blob),
            "created": time.time(),
        },
        sort_keys=True,
    ).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header))
    return b"".join((prefix, header, token_bytes, blob))


def parse_header(
    head: bytes, fingerprint: Mapping[str, object], file_size: int
) -> tuple[dict[str, object], int]:
    """(header, offset of the token ids) from a file's first bytes; CorruptFile unless the
    magic, version, header checksum, fingerprint and total size all check out. `head` must hold
    at least the prefix and the header."""
    if len(head) < _PREFIX.size:
        raise CorruptFile("truncated before the header")
    magic, version, header_len, header_crc = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptFile("not a llama-grpc KV file (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptFile(f"format version {version}, expected {FORMAT_VERSION}")
    end = _PREFIX.size + header_len
    raw = head[_PREFIX.size : end]
    if len(raw) != header_len:
        raise CorruptFile("truncated inside the header")
    if zlib.crc32(raw) != header_crc:
        raise CorruptFile("header checksum mismatch")
    try:
        header = json.loads(raw)
        n_tokens, blob_bytes = int(header["n_tokens"]), int(header["blob_bytes"])
        int(header["tokens_crc32"]), int(header["blob_crc32"]), str(header["scope"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFile(f"unreadable header: {exc}") from None
    if header["fingerprint"] != dict(fingerprint):
        raise CorruptFile("written by another model or configuration")
    expected = end + 4 * n_tokens + blob_bytes
    if file_size != expected:
        raise CorruptFile(f"size {file_size} bytes, header says {expected}")
    return header, end


class KvDiskStore:
    """The disk tier of one engine (see the module docstring)."""

    def __init__(
        self, directory: str | Path, fingerprint: Mapping[str, object], max_bytes: int
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = dict(fingerprint)
        self.tag = fingerprint_tag(self.fingerprint)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._by_block: dict[bytes, set[str]] = {}
        self._num_bytes = 0  # of the indexed files
        self._dir_mtime_ns = -1
        self._generation = 0  # bumped by clear(): writes queued before it are dropped
        self._counters = _Counters()
        self._pending: queue.Queue[tuple[int, str, tuple[int, ...], bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        # told of every file indexed or forgotten, under the lock (KV events' DISK tier)
        self._listener: Callable[[str, str, Sequence[int] | None], None] | None = None
        self._reads: queue.Queue[tuple[str, str, ReadDone] | None] = queue.Queue(MAX_PENDING_READS)
        self._reader: threading.Thread | None = None
        self._reader_lock = threading.Lock()
        self.refresh()
        self._start_reader()  # from now on it keeps the index fresh

    def watch(self, listener: Callable[[str, str, Sequence[int] | None], None]) -> None:
        """Report every indexed file now (a restart announces what survived it), then every
        file indexed or forgotten: listener(name, scope, tokens or None), from any thread."""
        with self._lock:
            self._listener = listener
            for entry in self._entries.values():
                listener(entry.name, entry.scope, entry.tokens)

    # -- the index --------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Index files that appeared (another replica wrote them), forget those that went."""
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return
        if mtime == self._dir_mtime_ns:
            return
        self._dir_mtime_ns = mtime
        prefix = self.tag + "-"
        present: set[str] = set()
        try:  # on the engine thread: a directory gone or unreadable must not kill it
            with os.scandir(self.directory) as it:
                for item in it:
                    if item.name.startswith(prefix) and item.name.endswith(SUFFIX):
                        present.add(item.name)
                    elif item.name.endswith(".tmp"):
                        self._remove_stale_temp(item)
        except OSError as exc:
            log.warning("kv_disk_unreadable", error=f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            for name in set(self._entries) - present:
                self._forget(name)
        for name in present - set(self._entries):
            self._index_file(name)

    def _remove_stale_temp(self, item: os.DirEntry[str]) -> None:
        with contextlib.suppress(OSError):
            if time.time() - item.stat().st_mtime > STALE_TEMP_S:
                os.unlink(item.path)

    def _index_file(self, name: str) -> None:
        path = self.directory / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(_PREFIX.size)
                if len(head) == _PREFIX.size:
                    head += f.read(_PREFIX.unpack_from(head)[2])
                header, offset = parse_header(head, self.fingerprint, size)
                f.seek(offset)
                token_bytes = f.read(4 * int(header["n_tokens"]))  # type: ignore[call-overload]
        except FileNotFoundError:
            return  # evicted meanwhile by another process
        except (OSError, CorruptFile) as exc:
            self._reject(name, str(exc))
            return
        if zlib.crc32(token_bytes) != header["tokens_crc32"]:
            self._reject(name, "token ids checksum mismatch")
            return
        tokens = array("i")
        tokens.frombytes(token_bytes)
        entry = _Entry(
            name,
            str(header["scope"]),
            tokens,
            size,
            offset + len(token_bytes),
            int(header["blob_bytes"]),  # type: ignore[call-overload]
            int(header["blob_crc32"]),  # type: ignore[call-overload]
        )
        entry.chain = block_chain(entry.scope, tokens.tolist())
        with self._lock:
            self._forget(name)  # indexed twice: by the writer and by a refresh
            self._entries[name] = entry
            self._num_bytes += size
            if self._listener is not None:
                self._listener(name, entry.scope, entry.tokens)
            for h in entry.chain:
                self._by_block.setdefault(h, set()).add(name)

    def _forget(self, name: str) -> None:
        """Drop a file from the index (with the lock held)."""
        entry = self._entries.pop(name, None)
        if entry is None:
            return
        self._num_bytes -= entry.size
        if self._listener is not None:
            self._listener(name, entry.scope, None)
        for h in entry.chain:
            names = self._by_block.get(h)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_block[h]

    def _reject(self, name: str, why: str) -> None:
        """A file that must not be used: one warning, then it is deleted."""
        log.warning("kv_disk_file_rejected", file=name, reason=why)
        self._counters.verify_failures += 1
        with self._lock:
            self._forget(name)
        with contextlib.suppress(OSError):
            os.unlink(self.directory / name)

    # -- reading --------------------------------------------------------------------------------

    def lookup(self, scope: str, tokens: Sequence[int]) -> tuple[str, int]:
        """(file name, usable prefix) of the file sharing the longest verified prefix with
        `tokens` in `scope`; ("", 0) when none shares a full block. At least the last token is
        left to compute. The index only (the engine thread calls it): the reader thread keeps
        it fresh."""
        self._start_reader()
        names: set[str] = set()
        with self._lock:
            for h in iter_chain(scope, tokens):
                found = self._by_block.get(h)
                if not found:
                    break
                names = found
            candidates = [self._entries[n] for n in names if n in self._entries]
        best, best_n = "", 0
        for entry in candidates[:MAX_CANDIDATES]:
            if entry.scope != scope:
                continue
            n = min(common_prefix_length(entry.tokens.tolist(), tokens), len(tokens) - 1)
            if n > best_n:
                best, best_n = entry.name, n
        return best, best_n

    def read(self, name: str, scope: str, done: ReadDone) -> bool:
        """Read and verify a file on the reader thread, then call `done` there with what load()
        returns. False (and `done` is never called) when MAX_PENDING_READS are queued already."""
        self._start_reader()
        try:
            self._reads.put_nowait((name, scope, done))
        except queue.Full:
            self._counters.read_failures += 1
            return False
        return True

    def _start_reader(self) -> None:
        with self._reader_lock:
            if self._reader is None:
                self._reader = threading.Thread(
                    target=self._read_loop, name="kv-disk-read", daemon=True
                )
                self._reader.start()

    def _read_loop(self) -> None:
        """Reads in order; the index refresh whenever REFRESH_S passed (and while idle)."""
        refreshed = time.monotonic()
        while True:
            wait = max(0.0, refreshed + REFRESH_S - time.monotonic())
            try:
                item: tuple[str, str, ReadDone] | None = self._reads.get(timeout=wait)
            except queue.Empty:
                item = ("", "", _no_read)
            if item is None:
                return
            name, scope, done = item
            if name:
                loaded = self._load_safely(name, scope)
                try:
                    done(loaded)
                except Exception:  # the reader must outlive a broken callback
                    log.exception("kv_disk_read_callback_failed")
            if time.monotonic() - refreshed >= REFRESH_S:
                self._refresh_safely()
                refreshed = time.monotonic()

    def _load_safely(self, name: str, scope: str) -> tuple[list[int], bytes] | None:
        try:
            loaded = self.load(name, scope)
        except Exception as exc:  # anything a broken volume raises is a failed read
            log.warning("kv_disk_read_failed", file=name, error=f"{type(exc).__name__}: {exc}")
            loaded = None
        if loaded is None:
            self._counters.read_failures += 1
        return loaded

    def _refresh_safely(self) -> None:
        try:
            self.refresh()
        except Exception as exc:
            log.warning("kv_disk_refresh_failed", error=f"{type(exc).__name__}: {exc}")

    def _read_file(self, path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def load(self, name: str, scope: str) -> tuple[list[int], bytes] | None:
        """The tokens and blob of an indexed file, verified again in full (it may have changed
        since it was indexed); None when it is gone or fails a check (then it is deleted).
        Blocking: the reader thread's (read())."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or entry.scope != scope:
            return None
        path = self.directory / name
        t0 = time.perf_counter()
        try:
            data = self._read_file(path)
        except FileNotFoundError:
            with self._lock:
                self._forget(name)
            return None
        except OSError as exc:
            self._reject(name, f"unreadable: {exc}")
            return None
        try:
            header, offset = parse_header(data, self.fingerprint, len(data))
            n_tokens = int(header["n_tokens"])  # type: ignore[call-overload]
            token_bytes = data[offset : offset + 4 * n_tokens]
            blob = data[offset + 4 * n_tokens :]
            if header["scope"] != scope:
                raise CorruptFile("scope changed since indexed")
            if zlib.crc32(token_bytes) != header["tokens_crc32"]:
                raise CorruptFile("token ids checksum mismatch")
            if zlib.crc32(blob) != header["blob_crc32"]:
                raise CorruptFile("KV state checksum mismatch")
        except CorruptFile as exc:
            self._reject(name, str(exc))
            return None
        tokens = array("i")
        tokens.frombytes(token_bytes)
        with contextlib.suppress(OSError):
            os.utime(path)  # last use, shared with every process using the directory
        self._counters.read_seconds += time.perf_counter() - t0
        self._counters.read_bytes += len(data)
        self._counters.hits += 1
        return tokens.tolist(), blob

    def held(self) -> list[tuple[str, list[int]]]:
        """(scope, tokens) of every indexed file."""
        with self._lock:
            return [(e.scope, e.tokens.tolist()) for e in self._entries.values()]

    def record_miss(self) -> None:
        """A lookup that restored nothing from disk."""
        self._counters.misses += 1

    def stats(self) -> DiskTierStats:
        """The figures now (any thread: the engine's for its snapshot, GetStats' and scrapes'
        through EngineLoop.stats, while the writer thread writes)."""
        c = self._counters
        with self._lock:
            entries, num_bytes = len(self._entries), self._num_bytes
        return DiskTierStats(
            entries=entries,
            bytes=num_bytes,
            hits=c.hits,
            misses=c.misses,
            writes=c.writes,
            evictions=c.evictions,
            verify_failures=c.verify_failures,
            read_seconds=c.read_seconds,
            read_bytes=c.read_bytes,
            write_failures=c.write_failures,
            read_failures=c.read_failures,
        )

    # -- writing (writer thread) ------------------------------------------------------------------

    def put(self, scope: str, tokens: Sequence[int], blob: bytes) -> None:
        """Save a state in the background (never blocks the caller)."""
        if len(tokens) < BLOCK_TOKENS or not blob:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
            self._writer.start()
        self._pending.put((self._generation, scope, tuple(tokens), blob))

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        if self._writer is not None:
            self._pending.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer and reader threads (a read in flight
        is not waited for: a blocked volume must not hold up a shutdown)."""
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join()
            self._writer = None
        with self._reader_lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(queue.Full):
                self._reads.put_nowait(None)

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as exc:  # a full or read-only disk must never stop the engine
                self._counters.write_failures += 1
                log.warning("kv_disk_write_failed", error=f"{type(exc).__name__}: {exc}")
            finally:
                self._pending.task_done()

    def _write(self, generation: int, scope: str, tokens: tuple[int, ...], blob: bytes) -> None:
        digest = hashlib.blake2b(
            scope.encode() + b"\0" + array("i", tokens).tobytes(), digest_size=16
        ).hexdigest()
        name = f"{self.tag}-{digest}{SUFFIX}"
        path = self.directory / name
        if name in self._entries:  # the same scope + tokens: the same state, already saved
            with contextlib.suppress(OSError):
                os.utime(path)
            return
        data = encode(self.fingerprint, scope, tokens, blob)
        if len(data) > self.max_bytes:
            return
        tmp = self.directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        with self._lock:
            cleared = generation != self._generation  # cleared while this write was queued
        if cleared:
            tmp.unlink(missing_ok=True)
            return
        os.replace(tmp, path)  # without the lock: a slow volume must not hold up a lookup
        with self._lock:
            cleared = generation != self._generation
        if cleared:  # cleared during the rename
            path.unlink(missing_ok=True)
            return
        self._counters.writes += 1
        self._index_file(name)
        self._drop_superseded(scope, tokens, name)
        self._enforce_budget()

    def _drop_superseded(self, scope: str, tokens: tuple[int, ...], keep: str) -> None:
        """A file whose tokens are a prefix of the new file's is covered by it."""
        with self._lock:
            covered = [
                e.name
                for e in self._entries.values()
                if e.name != keep
                and e.scope == scope
                and len(e.tokens) <= len(tokens)
                and e.tokens.tolist() == list(tokens[: len(e.tokens)])
            ]
            for name in covered:
                self._forget(name)
        for name in covered:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)

    def _enforce_budget(self) -> None:
        """Delete the least recently used files (every fingerprint's: the budget is the
        directory's) until the directory fits max_bytes."""
        files: list[tuple[float, int, str]] = []
        with os.scandir(self.directory) as it:
            for item in it:
                if item.name.endswith(SUFFIX):
                    with contextlib.suppress(OSError):
                        st = item.stat()
                        files.append((st.st_mtime, st.st_size, item.name))
        total = sum(size for _, size, _ in files)
        for _, size, name in sorted(files):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)
                self._counters.evictions += 1
            total -= size
            with self._lock:
                self._forget(name)

    # -- admin ------------------------------------------------------------------------------------

    def clear(self) -> tuple[int, int]:
        """Delete every file of this fingerprint (and drop queued writes); (files, bytes)."""
        with self._lock:
            self._generation += 1
            entries = list(self._entries.values())
            self._entries.clear()
            if self._listener is not None:
                for entry in entries:
                    self._listener(entry.name, entry.scope, None)
            self._by_block.clear()
            self._num_bytes = 0
        freed, freed_bytes = 0, 0
        for entry in entries:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / entry.name)
                freed += 1
                freed_bytes += entry.size
        return freed, freed_bytes
