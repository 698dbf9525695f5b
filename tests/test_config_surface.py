"""One config surface: settings are fields of `EngineConfig` (its `kernels` included) or the
app's args, never switches read from the environment.

Read from the source with `ast`: no `os.environ` / `os.getenv` read of a `RADIXSERVE_` name
in the shipped packages, except engine/config.py (the cache directory and the test suite's
GC-freeze default) and the API keys (secrets, deployments/auth.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "deployments", "router", "frontend")
MAY_READ = {Path("engine/config.py"): "the engine's config module",
            Path("deployments/auth.py"): "API keys are secrets"}
SECRETS = {"RADIXSERVE_API_KEY", "RADIXSERVE_ADMIN_API_KEY"}


def _env_names(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "RADIXSERVE_..." constants: a read through them counts too."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            if isinstance(value, str) and value.startswith("RADIXSERVE_"):
                out.update({t.id: value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _reads_environ(node: ast.AST) -> bool:
    """`os.environ[...]`, `os.environ.get(...)` (any method), `os.getenv(...)`, `... in os.environ`."""
    names = {n.attr if isinstance(n, ast.Attribute) else n.id
             for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}
    return bool(names & {"environ", "getenv"})


def env_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every environment read of a RADIXSERVE_ name in `source`."""
    tree = ast.parse(source)
    constants = _env_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Call, ast.Subscript, ast.Compare)) or not _reads_environ(node):
            continue
        for leaf in ast.walk(node):
            if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str) \
                    and leaf.value.startswith("RADIXSERVE_"):
                found.append((node.lineno, leaf.value))
            elif isinstance(leaf, ast.Name) and leaf.id in constants:
                found.append((node.lineno, constants[leaf.id]))
    return sorted(set(found))


def violations() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            for line, name in env_reads(path.read_text()):
                if rel in MAY_READ and (rel.parts[0] == "engine" or name in SECRETS):
                    continue
                out.append(f"{rel}:{line} reads {name} from the environment")
    return out


def test_no_environment_switches():
    assert violations() == [], "make it a field of EngineConfig (or its kernels) or AppArgs"


@pytest.mark.parametrize("source, line", [
    ('import os\nON = os.environ.get("RADIXSERVE_FOO", "1") != "0"\n', 2),
    ('import os\ndef f():\n    return os.getenv("RADIXSERVE_FOO")\n', 3),
    ('import os\nKEY = "RADIXSERVE_FOO"\ndef f():\n    return os.environ[KEY]\n', 4),
    ('from os import environ\nON = "RADIXSERVE_FOO" in environ\n', 2),
])
def test_the_checker_sees_a_switch(source, line):
    assert env_reads(source) == [(line, "RADIXSERVE_FOO")]


def test_the_checker_leaves_other_names_alone():
    assert env_reads('import os\nX = os.environ.get("TRITON_INTERPRET")\nY = "RADIXSERVE_FOO"\n') == []
