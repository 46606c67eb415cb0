"""Which artifacts' programs may run: an artifact's program.py is Python that loading executes.

Pointing `--model` at a folder would otherwise run whatever its program.py says, as unpickling
would. So every artifact records the SHA-256 of its program and weights in kvserve.json, and kvserve
keeps, in its cache folder, the list of the program hashes it exported itself. Loading runs a program
only if both files still have their recorded hashes and the program is on that list, or if the user
says they trust the folder (`--trust-artifact`).
"""
from __future__ import annotations

import os
from pathlib import Path

from .catalog import cache_dir, sha256_of
from .errors import ModelLoadError

TRUST_FILE = "trusted-programs"


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
        if sha256_of(folder / name) != want:
            raise ModelLoadError(f"{folder}: {name} does not have the hash kvserve.json records: it changed after "
                                 f"export; refusing to run it ({advice})")
    if recorded[files[0]] not in trusted_hashes():
        raise ModelLoadError(f"{folder}: its {files[0]} was not exported by kvserve here (not in "
                             f"{cache_dir() / TRUST_FILE}); refusing to run it ({advice})")
