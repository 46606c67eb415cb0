"""The README's examples, run as a reader would run them, against a live server on the served model:
every shell block that calls curl on the server, and every Python block. The README cannot drift from
the product without this failing."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```(sh|python)\n(.*?)```", README, re.S)
CURL = [code for lang, code in BLOCKS if lang == "sh" and "curl " in code]
PYTHON = [code for lang, code in BLOCKS if lang == "python"]


def on(server, code: str) -> str:
    """The example aimed at the test's server instead of the default port."""
    return re.sub(r"(localhost|127\.0\.0\.1):8000", server.url.removeprefix("http://"), code)


def test_the_readme_has_the_examples_this_file_runs():
    assert len(CURL) >= 2 and len(PYTHON) >= 1
    # the plain `curl -d` without a content type, which llama-server accepts too
    assert any("generate_stream -d" in code for code in CURL)


@pytest.mark.parametrize("index", range(len(CURL)))
def test_a_readme_shell_example_runs(fast_server, index):
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", on(fast_server, CURL[index])], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and '"error"' not in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_a_readme_python_example_runs(fast_server, index):
    run = subprocess.run([sys.executable, "-c", on(fast_server, PYTHON[index])], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
