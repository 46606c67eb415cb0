"""A disk tier under the block pool: full KV blocks by content, and session records, in one folder.

Layout, under `--kv-disk DIR`:
    DIR/<identity>/manifest.json         what the identity hashes: weights, weight mode, KV dtype, block size, tokenizer
    DIR/<identity>/blocks/ab/cd/<hash>   one full block: header, token ids, K, V, then a checksum of all of it
    DIR/<identity>/sessions/<key>.json   a persistent session's record (id, tokens, capacity, sizing, owner hash, expiry,
                                         identity), by its id within its owner's namespace
The identity folder keeps the KV of one model (and KV dtype, and block size) apart from every other:
a server with another identity sees none of it, so it never serves KV another model wrote. A block is
named by its chained hash (which covers every token before it) and re-checked on the way back: its
checksum, its identity and its token ids must all hold, or the file is dropped and the block recomputed.

Every write is a temporary file renamed into place, so a reader never sees half a file, and writes
run on the tier's own thread (write-behind): the step loop only hands over a copy of the block. Reads
run on a second thread, while the request waits in the queue. A file that fails costs that file alone,
a full disk pauses writes but never reads, and only a vanished or read-only folder turns the tier off
(kvcache/disk_faults.py); serving goes on from RAM.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .disk_faults import DiskFaults
from .disk_files import Refused, make_folders, read_regular, write_atomic
from .disk_records import SessionRecords

log = logging.getLogger("kvserve.disk")

MAGIC = b"KVB1"
_CHECK = 4  # bytes of the CRC-32 at the end of a block file: it finds damage; the identity, hash and ids find the rest


@dataclass
class TierStats:
    """Counters the engine turns into metrics."""

    hits: int = 0  # blocks read back for a prefix
    misses: int = 0  # blocks looked up and not on disk
    errors: int = 0  # I/O failures and files that failed their checks
    read_s: list[float] = field(default_factory=list)  # per read-back (one request's blocks), drained
    write_s: list[float] = field(default_factory=list)  # per block written, drained


class DiskTier(SessionRecords, DiskFaults):
    """Content-addressed KV blocks and session records for one model identity, under a byte budget."""

    def __init__(self, root: Path, budget: int, identity: dict, block_bytes: int, block_size: int,
                 k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.identity = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=8).hexdigest()
        self.root = Path(root) / self.identity
        self.budget, self.block_size = budget, block_size
        self.k_shape, self.v_shape, self.dtype = k_shape, v_shape, dtype
        self.file_bytes = len(MAGIC) + 8 + 16 + 8 * block_size + block_bytes + _CHECK
        self.stats = TierStats()
        self._init_faults()
        self._lock = threading.Lock()
        self._on_disk: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._writes: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        # What this server wrote to the folder and removed from it, in order, while a listener (KV events for a
        # router) drains it with take_events: ("stored", digest, parent digest or None, token ids), ("removed", digest).
        # None: nobody listens. Blocks found in the folder, not written here, are never announced.
        self.events: list[tuple] | None = None
        self._init_records()
        try:
            make_folders(self.root / "blocks", Path(root))
            make_folders(self.root / "sessions", Path(root))
            self._scan()
        except OSError as e:
            self._fail(e)
        else:
            self._write_manifest(identity)
        try:
            others = [p.name for p in Path(root).iterdir() if p.is_dir() and p.name != self.identity]
        except OSError:
            others = []
        if others:
            log.warning("kv disk %s also holds KV of %d other model identities; it is never reused here", root, len(others))
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-disk-reader")

    # ---- blocks ------------------------------------------------------------------------------
    def has(self, digest: bytes) -> bool:
        """Whether the block is on disk: one this server wrote or found at start, or one another server on
        the shared folder wrote since (looked up on disk, then known)."""
        if digest in self._on_disk:
            return True
        if not self._path(digest).is_file():
            return False
        with self._lock:
            self._on_disk[digest] = None
        return True

    def offer(self, digest: bytes, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor,
              parent: bytes | None = None) -> None:
        """Write a full block behind (the caller hands over copies), unless it is on disk already; `parent`
        is the hash of the block before it, for the events."""
        if digest in self._on_disk or not self.may_write():
            return
        self._enqueue(("block", digest, list(tokens), k, v, parent))

    def prefetch(self, hashes: Sequence[bytes], tokens: Sequence[int]) -> Future:
        """Read back, on the reader thread, the blocks of `hashes` (chained hashes of `tokens`'s full
        blocks) that are on disk, from the first one on, up to the first missing or bad one ->
        a future of {digest: (k, v)}."""
        return self._reader.submit(self._read_prefix, list(hashes), list(tokens))

    def _read_prefix(self, hashes: list[bytes], tokens: list[int]) -> dict[bytes, tuple[torch.Tensor, torch.Tensor]]:
        start, out, b = time.perf_counter(), {}, self.block_size
        for i, digest in enumerate(hashes):
            if not self.has(digest):
                self.stats.misses += 1
                break
            got = self._read(digest, tokens[i * b : (i + 1) * b])
            if got is None:
                break
            out[digest] = got
            self.stats.hits += 1
            with self._lock:
                if digest in self._on_disk:
                    self._on_disk.move_to_end(digest)
        if out:
            self.stats.read_s.append(time.perf_counter() - start)
        return out

    def _read(self, digest: bytes, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        path = self._path(digest)
        try:
            data = bytearray(read_regular(path, self.file_bytes + 1))
        except Refused:  # a symlink, say: dropped as a damaged block is, and never read
            data = bytearray()
        except OSError:
            self._forget(digest)
            return None
        view, head = memoryview(data), len(MAGIC) + 8 + 16
        ids_end = head + 8 * self.block_size
        ok = (len(data) == self.file_bytes
              and zlib.crc32(view[:-_CHECK]).to_bytes(_CHECK, "little") == bytes(view[-_CHECK:])
              and bytes(view[:head]) == MAGIC + bytes.fromhex(self.identity) + digest
              and torch.frombuffer(data, dtype=torch.int64, count=self.block_size, offset=head).tolist()[: len(tokens)] == tokens)
        if not ok:
            self.stats.errors += 1
            log.warning("kv disk: block %s failed its checks; dropped, it will be recomputed", digest.hex())
            self._forget(digest)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        n_k, n_v = math.prod(self.k_shape), math.prod(self.v_shape)
        kv = torch.frombuffer(data, dtype=self.dtype, count=n_k + n_v, offset=ids_end)  # shares `data`: no copy
        return kv[:n_k].view(self.k_shape), kv[n_k:].view(self.v_shape)

    # ---- the writer ------------------------------------------------------------------------
    def _enqueue(self, job: tuple) -> None:
        with self._lock:
            self._pending += 1
        self._writes.put(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write handed over so far is on disk (or given up) -> whether it finished."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    @property
    def pending(self) -> int:
        return self._pending

    def close(self) -> None:
        self.flush(timeout=60)
        self._writes.put(None)
        self._reader.shutdown(wait=True)
        for session_id in list(self._claims):
            self.unclaim(session_id)

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            try:
                if self.healthy:
                    self._do(job)
            except OSError as e:
                self._failed(e, _what(job))
            except Exception:  # a bug here must not stop the writer, nor serving
                log.exception("kv disk writer")
            finally:
                if job[0] == "session" and not job[2].done():  # not written: whoever waits for it goes on
                    job[2].set_result(False)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _do(self, job: tuple) -> None:
        if job[0] in ("session", "delete", "release"):
            self._do_record(job)
        else:
            _, digest, tokens, k, v, parent = job
            if digest in self._on_disk or self.file_bytes > self.budget or not self.may_write():
                return
            start = time.perf_counter()
            self._make_room()
            ids = torch.tensor(tokens + [0] * (self.block_size - len(tokens)), dtype=torch.int64)
            parts = [MAGIC + bytes.fromhex(self.identity) + digest, ids.numpy().data,
                     k.contiguous().view(torch.uint8).numpy().data, v.contiguous().view(torch.uint8).numpy().data]
            crc = 0
            for part in parts:
                crc = zlib.crc32(part, crc)
            path = self._path(digest)
            make_folders(path.parent, self.root / "blocks")
            write_atomic(path, [*parts, crc.to_bytes(_CHECK, "little")])
            self._wrote()
            with self._lock:
                self._on_disk[digest] = None
                self._note("stored", digest, parent, tokens)
            self.stats.write_s.append(time.perf_counter() - start)

    def _make_room(self) -> None:
        """The budget is a hard bound: the least recently used blocks go first."""
        while (len(self._on_disk) + 1) * self.file_bytes > self.budget and self._on_disk:
            with self._lock:
                digest, _ = self._on_disk.popitem(last=False)
                self._note("removed", digest)
            try:
                self._path(digest).unlink(missing_ok=True)
            except OSError as e:  # out of the budget all the same: the file is no longer counted
                self._failed(e, f"block {digest.hex()}")

    # ---- helpers -----------------------------------------------------------------------------
    def _write_manifest(self, identity: dict) -> None:
        """What the identity folder's name hashes, for whoever looks; left as it is if it says so already
        (a restart on a full disk needs no write)."""
        path, data = self.root / "manifest.json", json.dumps({"identity": identity}, indent=2).encode()
        try:
            if read_regular(path, len(data) + 1) == data:
                return
        except OSError:
            pass
        try:
            write_atomic(path, data)
        except OSError as e:
            self._failed(e, "manifest.json")

    def _path(self, digest: bytes) -> Path:
        h = digest.hex()
        return self.root / "blocks" / h[:2] / h[2:4] / h

    def _scan(self) -> None:
        found = []
        for path in (self.root / "blocks").glob("*/*/*"):
            if path.name.endswith(".tmp"):
                # a write in progress, perhaps by another live server on the folder: never ours to delete
                continue
            try:
                found.append((path.stat().st_mtime, bytes.fromhex(path.name)))
            except (OSError, ValueError):
                continue
        for _, digest in sorted(found):
            self._on_disk[digest] = None

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            if digest in self._on_disk:
                del self._on_disk[digest]
                self._note("removed", digest)

    def _note(self, *event) -> None:
        """Under the lock."""
        if self.events is not None:
            self.events.append(event)

    def take_events(self) -> list[tuple]:
        with self._lock:
            events, self.events = self.events, ([] if self.events is not None else None)
        return events or []

    def info(self) -> dict:
        return {"path": str(self.root), "healthy": self.healthy, "writes_paused": self.writes_paused,
                "full_since": self.full_since, "blocks": len(self._on_disk),
                "bytes": len(self._on_disk) * self.file_bytes, "budget": self.budget, "pending_writes": self._pending,
                "hits": self.stats.hits, "misses": self.stats.misses, "errors": self.stats.errors}


def _what(job: tuple) -> str:
    """The file a writer's job touches, in words (for its warning, given once per file)."""
    if job[0] == "block":
        return f"block {job[1].hex()}"
    if job[0] == "session":
        return f"record of session {job[1]['key']}"
    return f"record of session {job[1]}"
