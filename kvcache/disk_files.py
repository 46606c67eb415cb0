"""How the disk tier touches its folder: never through a symlink, and for its owner alone.

Whoever else can write into the folder (another account on shared storage, a file planted before the
server started) must not make the server read or write anywhere else through it. So every file is
opened with O_NOFOLLOW and must be a regular file, a new temporary file is created exclusively (O_EXCL,
so a symlink planted at its name is refused, never followed), and a folder of the tier's own that turns
out to be a symlink is refused. The files hold conversations (token ids, their KV, stored responses), so
each is created 0600 and each folder 0700: the umask may only narrow that.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

FILE_MODE, FOLDER_MODE = 0o600, 0o700


class Refused(OSError):
    """A path the tier will not open: a symlink, or not a regular file."""


def _open(path: Path, flags: int) -> int:
    # O_NONBLOCK: a FIFO planted in the folder opens at once (and is then refused) instead of hanging the tier
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused(errno.ELOOP, "a symlink, never followed", str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(errno.EINVAL, "not a regular file", str(path))
    return fd


def read_regular(path: Path, limit: int = -1) -> bytes:
    """A regular file's bytes (at most `limit` of them) -> raises Refused, or another OSError."""
    with os.fdopen(_open(path, os.O_RDONLY), "rb") as f:
        return f.read(limit)


def open_lock(path: Path) -> int:
    """A lock file's descriptor, the file created 0600 if missing -> raises Refused, or another OSError."""
    return _open(path, os.O_RDWR | os.O_CREAT)


def write_atomic(path: Path, data: bytes | list, sync: bool = False) -> None:
    """Write `data` (bytes, or buffers written in turn, never joined) to a new temporary file, then rename it
    (a rename replaces a symlink at `path`, never writes through it)."""
    # a random part: two servers on one folder never share a name, and none can be planted ahead
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave half files behind
        raise


def make_folders(path: Path, top: Path) -> None:
    """Make `path` (`top` or a folder below it) and every missing folder on the way, each 0700 (Path.mkdir
    gives parents the default mode). `top` may be the operator's symlink; one below it is refused."""
    below = path != top
    if below:
        make_folders(path.parent, top)
    try:
        path.mkdir(mode=FOLDER_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        if below:
            raise
        make_folders(path.parent, path.parent)  # the folders above `top`, when the server makes them too
        path.mkdir(mode=FOLDER_MODE, exist_ok=True)
    if below and not stat.S_ISDIR(os.lstat(path).st_mode):
        raise Refused(errno.ENOTDIR, "not a folder of the tier's own", str(path))
