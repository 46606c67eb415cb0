"""A server stopped while its background compile runs leaves no compiler running and no partial package
beside the artifact (issue 67: an orphaned g++/cc1plus and a 0-byte temporary .pt2 stayed)."""
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from models import load_model
from models.compiled_program import PACKAGE_FILE
from models.quant import model_kernels_available

from ..live_server import free_port, start_cli_server

pytestmark = pytest.mark.slow
COMPILERS = ("cc1plus", "g++", "c++", "gcc", "ld")


def processes() -> dict[int, tuple[str, int, str]]:
    """pid -> (name, parent pid, state) of every process now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = (name, int(rest[1]), rest[0])
    return out


def descendants(root: int, table: dict) -> set[int]:
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (_, ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(watched: dict[int, str]) -> list[tuple[int, str]]:
    table = processes()
    return [(p, n) for p, n in watched.items() if p in table and table[p][0] == n and table[p][2] != "Z"]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_server_mid_compile_ends_the_compilers_and_the_partial_package(tmp_path, how):
    if not model_kernels_available():
        pytest.skip("the native kernels do not build here, so nothing compiles in the background")
    folder = tmp_path / "artifact"
    shutil.copytree(load_model("smollm2-135m-instruct", weights="auto").folder, folder)
    (folder / PACKAGE_FILE).unlink(missing_ok=True)
    server = start_cli_server(["--model", str(folder)], free_port())
    try:
        deadline, watched = time.monotonic() + 600, {}
        while time.monotonic() < deadline and not any(name in COMPILERS for name in watched.values()):
            table = processes()  # until a compiler runs under the server: the compile and all it started
            watched = {p: table[p][0] for p in descendants(server.pid, table)}
            time.sleep(0.2)
        assert watched, "no compiler started within 600 s"
        os.kill(server.pid, how)
        server.wait(timeout=120)
        deadline = time.monotonic() + 10  # a compiler left alone would run on for many seconds
        while time.monotonic() < deadline and alive(watched):
            time.sleep(0.2)
        assert not alive(watched), f"still running after the server: {alive(watched)}"
        assert list(tmp_path.glob(f".{folder.name}.*.pt2")) == []
        assert not (folder / PACKAGE_FILE).exists()
    finally:
        if server.poll() is None:
            server.kill()
