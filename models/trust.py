"""Which artifacts' programs may run: an artifact's program.py is Python that loading executes.

Pointing `--model` at a folder would otherwise run whatever its program.py says, as unpickling
would. So every artifact records the SHA-256 of its program and weights in kvserve.json, and kvserve
keeps, in its cache folder, the list of the program hashes it exported itself. Loading runs a program
only if both files still have their recorded hashes and the program is on that list, or if the user
says they trust the folder (`--trust-artifact`).

A file once hashed is known again by its stat (verified_stamp), so a start does not read an 18 GB
weights file a second time just to hash it.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .catalog import cache_dir, sha256_of
from .errors import ModelLoadError

TRUST_FILE = "trusted-programs"
VERIFIED_FOLDER = "verified-files"


def trusted_hashes() -> set[str]:
    path = cache_dir() / TRUST_FILE
    return set(path.read_text().split()) if path.is_file() else set()


def trust(program_sha256: str) -> None:
    """Put a program kvserve exported on the list (one appended line: concurrent exports keep both)."""
    path = cache_dir() / TRUST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{program_sha256}\n".encode())
    finally:
        os.close(fd)


def check(folder: Path, recorded: dict, files: tuple[str, ...]) -> None:
    """Raise ModelLoadError unless `files` of `folder` have the hashes kvserve.json recorded for them and
    the program (the first) is one kvserve exported."""
    advice = "if you trust the code of this folder, load it with --trust-artifact"
    for name in files:
        want = recorded.get(name)
        if want is None:
            raise ModelLoadError(f"{folder}: kvserve.json records no hash of {name}; export it again, or {advice}")
        if not has_hash(folder / name, want):
            raise ModelLoadError(f"{folder}: {name} does not have the hash kvserve.json records: it changed after "
                                 f"export; refusing to run it ({advice})")
    if recorded[files[0]] not in trusted_hashes():
        raise ModelLoadError(f"{folder}: its {files[0]} was not exported by kvserve here (not in "
                             f"{cache_dir() / TRUST_FILE}); refusing to run it ({advice})")


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def remember(path: Path, sha256: str) -> None:
    """Record that `path`, as it is now, has `sha256` (where the cache folder can be written)."""
    folder = cache_dir() / VERIFIED_FOLDER
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{sha256}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(_stamp(path)))
        tmp.replace(folder / sha256)


def has_hash(path: Path, sha256: str) -> bool:
    """Whether path has that SHA-256: known without reading it where its stat is the one recorded when it
    last had it. Any write to a file moves its ctime, which no call sets back, so a file changed in place,
    its mtime restored, is hashed again; a copy is another inode."""
    try:
        if json.loads((cache_dir() / VERIFIED_FOLDER / sha256).read_text()) == _stamp(path):
            return True
    except (OSError, ValueError):
        pass
    if sha256_of(path) != sha256:
        return False
    remember(path, sha256)
    return True
