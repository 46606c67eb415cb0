"""Session records on the disk tier: one JSON file per persistent session (its history and owner hash,
never its KV, which the tier keeps by content), and the claims that make a session one live server's
among those sharing the folder. A claim's lock file names its holder (its boot id), so a server asked
for a session another holds can tell which one to send the request to (server/api/peers.py).

A record is written (temporary file, fsync, rename) on the tier's writer thread, and whoever saves one
gets a future of whether it is on disk: a turn's final event waits for it (server/engine/engine.py), so a
turn a client was answered is on disk, whenever the server dies after.

A mixin of `DiskTier` (kvcache/disk_tier.py), which owns what is used here: `root`, `identity`,
`healthy`, `may_write`, `stats`, `_lock`, `_enqueue`, `_failed` and `_wrote`, and runs `_do_record` on its
writer thread.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from concurrent.futures import Future
from pathlib import Path

from .disk_faults import FULL
from .disk_files import Refused, open_lock, read_regular, write_atomic

log = logging.getLogger("kvserve.disk")

RECORD_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# what a record is filed under: its session's id, within its owner's namespace (server/engine/session.py)
RECORD_KEY = re.compile(r"([0-9a-f]{32}\.)?[A-Za-z0-9_-]{1,128}")
HOLDER = re.compile(r"[0-9a-f]{32}")  # a server's boot id, as a claim's lock file names its holder


class SessionRecords:
    """Records and claims of persistent sessions, by key: a session's id within its owner's namespace."""

    def _init_records(self) -> None:
        self._claims: dict[str, int] = {}  # session key -> the open, flock-ed lock file that makes it ours
        self._deleted: set[str] = set()  # deleted here, its record perhaps not yet unlinked: never found again
        self._letting_go: set[str] = set()  # claims the writer drops once it gets there, unless claimed again first
        self.holder: str | None = None  # this server's boot id, written into each lock file it holds

    def save_session(self, record: dict) -> Future | None:
        """Write a session's record behind (temporary file, fsync, rename) -> a future of whether it is on
        disk, or None if no write is tried (the tier is off, or paused for a full disk)."""
        if not self.may_write():
            return None
        saved = Future()
        self._enqueue(("session", {**record, "identity": self.identity}, saved))
        return saved

    def delete_session(self, key: str) -> None:
        self._deleted.add(key)
        self._let_go(key)
        self._enqueue(("delete", key))

    def _record_at(self, path: Path) -> dict:
        """The session record in `path` -> raises OSError, or ValueError unless it parses as one and was
        written for this model identity."""
        record = json.loads(read_regular(path))
        if not _valid_record(record) or record.get("identity") != self.identity:
            raise ValueError("not a session record of this model identity")
        return {**record, "key": record.get("key", record["id"])}  # records before namespaces: the id

    def claim(self, key: str) -> bool:
        """Make a session this server's alone, among the servers sharing the folder -> False if another
        live server holds it, or its lock file cannot be had (a symlink, a folder: that session alone is not
        taken, with one warning). The claim is
        an flock on the session's lock file: the kernel releases it when the holder dies, however it dies,
        so a session outlives its server on shared storage."""
        self._deleted.discard(key)  # a new session under a key deleted earlier
        with self._lock:
            self._letting_go.discard(key)  # ours again: the writer keeps the lock it was to drop
        if key in self._claims or not self.healthy:
            return True
        try:
            fd = open_lock(self.root / "sessions" / f"{key}.lock")
        except Refused as e:  # planted by someone who may write in the folder: not a claim anyone holds
            self.stats.errors += 1
            self._warn_once(f"lock of session {key}", f"kv disk: lock of session {key} refused ({e.strerror}); "
                            "the session is not taken")
            return False
        except OSError as e:
            self._failed(e, f"lock of session {key}")
            # a full disk has no room for a new lock file: nobody else can hold one either
            return e.errno in FULL
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._claims[key] = fd
        self._sign(fd)
        return True

    def _sign(self, fd: int) -> None:
        """Name this server in a lock file it now holds: the name a previous holder left is that of a dead one."""
        if self.holder is None:
            return
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.holder.encode(), 0)
        except OSError:  # the claim stands; only a request sent here by a peer would need the name
            pass

    def holder_of(self, key: str) -> str | None:
        """The boot id a live server wrote into the lock file of a session it holds -> None if there is none
        (a holder without one, or the moment between its lock and its write)."""
        try:
            text = read_regular(self.root / "sessions" / f"{key}.lock", 64).decode("ascii", "replace").strip()
        except OSError:
            return None
        return text if HOLDER.fullmatch(text) else None

    def release(self, key: str) -> None:
        """Let the session go, once the writes handed over before are on disk: another server may claim it."""
        self._let_go(key)
        self._enqueue(("release", key))

    def _let_go(self, key: str) -> None:
        with self._lock:
            self._letting_go.add(key)

    def unclaim(self, key: str) -> None:
        fd = self._claims.pop(key, None)
        if fd is not None:
            os.close(fd)  # closing the file drops its lock

    def find_session(self, key: str) -> dict | None:
        """A session's record, if one is on disk and parses (a server beside this one may have written it)."""
        if not self.healthy or RECORD_KEY.fullmatch(key) is None or key in self._deleted:
            return None
        try:
            record = self._record_at(self.root / "sessions" / f"{key}.json")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.stats.errors += 1
            self._warn_once(f"reading session {key}", f"kv disk: record of session {key} cannot be read "
                            f"({getattr(e, 'strerror', None) or e}); that session is not found")
            return None
        return record if record["key"] == key else None

    def sessions(self) -> list[dict]:
        """Every record that parses; one that does not is skipped with a warning."""
        records = []
        for path in sorted((self.root / "sessions").glob("*.json")) if self.healthy else []:
            try:
                record = self._record_at(path)
                if path.name != f"{record['key']}.json":
                    raise ValueError("a record under another session's name")
                records.append(record)
            except Refused as e:
                self.stats.errors += 1
                log.warning("kv disk: session record %s refused (%s); skipped", path.name, e.strerror)
            except (OSError, ValueError):
                self.stats.errors += 1
                log.warning("kv disk: session record %s does not parse; skipped", path.name)
        return records

    def _do_record(self, job: tuple) -> None:
        """On the writer's thread: a record written, a record deleted, or a claim let go."""
        kind = job[0]
        if kind == "session":
            record, saved = job[1], job[2]
            if record["key"] in self._deleted or not self.may_write():
                saved.set_result(False)
                return
            write_atomic(self.root / "sessions" / f"{record['key']}.json", json.dumps(record).encode(), sync=True)
            self._wrote()
            saved.set_result(True)
            return
        if kind == "delete":
            try:
                (self.root / "sessions" / f"{job[1]}.json").unlink(missing_ok=True)
            except OSError as e:  # the claim is let go all the same
                self._failed(e, f"record of session {job[1]}")
        with self._lock:
            drop = job[1] in self._letting_go
            self._letting_go.discard(job[1])
        if drop:
            self.unclaim(job[1])


def _valid_record(r) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("id"), str) and RECORD_ID.fullmatch(r["id"]) is not None
            and isinstance(r.get("tokens"), list) and all(type(t) is int and t >= 0 for t in r["tokens"])
            and type(r.get("capacity")) is int and r["capacity"] > 0 and r.get("sizing") in ("static", "dynamic")
            and (r.get("owner") is None or isinstance(r["owner"], str)) and len(r["tokens"]) <= r["capacity"]
            and (r.get("key") is None or isinstance(r["key"], str) and RECORD_KEY.fullmatch(r["key"]) is not None)
            and (r.get("salt") is None or isinstance(r["salt"], str))
            and all(r.get(k) is None or type(r[k]) in (int, float) for k in ("expires", "used_at")))
