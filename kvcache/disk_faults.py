"""How the disk tier takes its failures, so that no one file and no full disk turns it off for everyone.

- A file that fails (a lock that is a folder, a record that cannot be written, a block folder that is a
  file) costs that file alone: its session or its block. It is warned about once and counted.
- A full disk (ENOSPC, EDQUOT) pauses writes; reads go on, so every session already on disk stays
  reachable and is restored at a restart. The first write tried once PROBE_S has passed probes the disk
  again, and the first that succeeds resumes writing.
- Only a tier whose own folders are gone, or a read-only file system, turns the tier off: serving goes on
  from RAM.

A mixin of `DiskTier` (kvcache/disk_tier.py), which owns `root` and `stats`.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

log = logging.getLogger("kvserve.disk")

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
PROBE_S = 5.0  # how long writes stay paused on a full disk before the next write tries again
_WARNED_MAX = 4096  # files warned about, remembered so that each is warned about once (then forgotten, in bulk)


class DiskFaults:
    """The tier's health: working, paused for a full disk, or off; and the files that failed."""

    def _init_faults(self) -> None:
        self.healthy = True  # False once the tier as a whole failed: RAM only, for good
        self.full_since: float | None = None  # wall-clock time writes paused for a full disk; None: writing
        self._probe_at = 0.0  # monotonic: when a write may try the full disk again
        self._warned: set[str] = set()

    @property
    def writes_paused(self) -> bool:
        return self.full_since is not None

    def may_write(self) -> bool:
        """Whether to try a write now: the tier works, and the disk is not full or it is time to probe it."""
        return self.healthy and (self.full_since is None or time.monotonic() >= self._probe_at)

    def _wrote(self) -> None:
        """A write succeeded: a full disk has room again."""
        if self.full_since is not None:
            self.full_since = None
            log.warning("kv disk %s has room again; writes resume", self.root)

    def _failed(self, error: OSError, what: str) -> None:
        """An I/O error on `what` (a file of the tier, in words): the disk is full, the tier is gone, or
        that file alone failed."""
        if error.errno == errno.EROFS or error.errno not in FULL and not self._folders_ok():
            self._fail(error)
            return
        self.stats.errors += 1
        if error.errno in FULL:
            self._probe_at = time.monotonic() + PROBE_S
            if self.full_since is None:
                self.full_since = time.time()
                log.warning("kv disk %s is full (%s); writes pause while sessions and blocks on it are still "
                            "read, and are tried again every %g s", self.root, error.strerror, PROBE_S)
            return
        self._warn_once(what, f"kv disk: {what} failed ({error.strerror or error}); it alone is skipped")

    def _warn_once(self, what: str, message: str) -> None:
        if what in self._warned:
            return
        if len(self._warned) >= _WARNED_MAX:
            self._warned.clear()
        self._warned.add(what)
        log.warning("%s", message)

    def _folders_ok(self) -> bool:
        """Whether the tier's own folders are still there, as folders."""
        try:
            return all(stat.S_ISDIR(os.lstat(self.root / name).st_mode) for name in ("blocks", "sessions"))
        except OSError:
            return False

    def _fail(self, error: OSError) -> None:
        """The tier as a whole failed: it is off from now on."""
        self.stats.errors += 1
        if self.healthy:
            log.warning("kv disk %s failed (%s); serving goes on from RAM only", self.root, error)
        self.healthy = False
