"""The layers of docs/design.md, read from the imports: data flows one way, and no layer reaches back."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# each package, and what it may not import (a prefix of the module's dotted name)
RULES = {
    "kvcache": ("models", "server"),
    "models": ("server",),
    "server/engine": ("server.api", "server.cli", "fastapi", "starlette", "uvicorn", "pydantic"),
}


def imports(source: str, package: tuple[str, ...]) -> set[str]:
    """Every module a file of `package` imports, as an absolute dotted name (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import api_x`
    return found


@pytest.mark.parametrize("package", RULES)
def test_no_layer_imports_the_layers_above_it(package):
    banned = RULES[package]
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package} holds no Python files"
    bad = {f"{f.relative_to(ROOT)} imports {m}" for f in files for m in imports(f.read_text(), f.relative_to(ROOT).parts[:-1])
           if any(m == b or m.startswith(b + ".") for b in banned)}
    assert not bad, "\n".join(sorted(bad))


def test_the_rules_resolve_relative_imports():
    """The check itself: relative imports, one or two floors up, resolve to the modules they name."""
    found = imports("from ..api.app import create_app\nfrom . import scheduler\nimport fastapi\n", ("server", "engine"))
    assert {"server.api.app", "server.engine.scheduler", "fastapi"} <= found
