"""The code's shape, checked statically: no import cycles, no reaching into
another module's private names, and each package imports only what its layer allows.

Read from the source with `ast` (nothing is imported), over the shipped packages
(`PACKAGES`); tests/ and scripts/ are tooling and may poke at internals.

Rules:
1. No import cycles between modules of the project. Every import statement counts,
   wherever it is (top level, inside a function, under `TYPE_CHECKING`): an import
   deferred to call time hides a cycle from Python but not from the reader. `from p import
   x` depends on module `p.x` when that is a module, else on `p` (a package's __init__);
   merely being inside package `p` is not a dependency on `p`'s __init__.
2. No private access across modules, except in the one Ray adapter (`RAY_ADAPTER`):
   - no import of an underscore name (`from m import _x`) or through an underscore module
     (`ray._private`, `ray.serve._private.common`);
   - `obj._x` (also `getattr(obj, "_x")`, `self._x`, `cls._x`) only when this module
     defines `_x`: at module level, in a class body, or by assigning `self._x` / `cls._x`.
     So a class's own privates are fine anywhere in its module (including on other
     instances, `other._x`), while another module's privates are not, whether reached
     on an object (`engine._step_sync()`, `handle._router`) or inherited from a base class
     defined elsewhere (`self._replica_queue_len_cache` in a Serve `RequestRouter`
     subclass). Dunders are not private; namedtuple's documented `_replace`, `_asdict`,
     `_fields`, `_make` are public API; the few other libraries' underscore names we use
     are listed, each with why, in `ALLOWED_PRIVATE`.
3. Layering (docs/architecture.md): engine/ imports none of the other packages; router/
   imports only the standard library, msgpack, Ray and itself; deployments/ imports from
   engine/ only `from engine import <name>` with the name in `engine.__all__`; frontend/
   (a client over HTTP) imports none of the other packages.
4. The engine's rooms (`ENGINE_ROOMS`): each room of engine/ imports only the rooms listed
   for it (below it in the step's story); `core` imports neither `executor` nor `kernels`.
5. Floors: a module sits one floor above the highest engine module it imports, so its
   floor is the length of its longest chain of imports (`floors`). Every import counts, as
   in rule 1: one inside a function, and one under `if TYPE_CHECKING:` too (a type names
   its module to the reader as surely as a call does: a collaborator handed in from above
   is typed by a small `typing.Protocol` at the user's floor instead). engine/ has at most
   `MAX_ENGINE_DEPTH` floors, and each room at most `ROOM_DEPTH[room]` counting only the
   imports inside it.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "deployments", "router", "frontend")
RAY_ADAPTER = "router.ray_adapter"
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make"}  # namedtuple's API
ALLOWED_PRIVATE = {  # `obj._x` as written -> why it is allowed
    "os._exit": "documented public API despite the underscore",
    "torch._scaled_mm": "torch's FP8 GEMM has no public name (torch 2.11); used in "
                        "engine/quantization/fp8.py only",
    "kernel._init_handles": "Triton's CompiledKernel loads its binary and launcher only "
                            "through it (3.6); engine/kernels/precompile.py only, a failure falls "
                            "back to the first launch",
}
ROUTER_MAY_IMPORT = {"msgpack", "ray", "router"}
# engine/<room> -> the rooms it may import (besides itself); `config` is engine/config.py.
_MODEL_SIDE = {"config", "core", "kernels", "quantization", "layers", "loading", "attention"}
ENGINE_ROOMS = {
    "config": set(),
    "core": {"config"},
    "grammar": {"config", "core"},
    "kernels": {"config"},
    "quantization": {"config", "kernels"},
    "layers": {"config", "kernels", "quantization"},
    "loading": {"config", "core", "kernels", "quantization", "layers"},
    "attention": {"config", "core", "kernels", "quantization"},
    "models": _MODEL_SIDE,
    "lora": {"config", "core", "kernels", "layers"},
    "executor": _MODEL_SIDE | {"grammar", "models", "lora"},
    "speculative": _MODEL_SIDE | {"grammar", "models", "executor", "lora"},
    "runtime": _MODEL_SIDE | {"grammar", "models", "executor", "speculative", "lora"},
}


# Rule 5: the most floors of imports (see `floors`) in all of engine/, and in a room.
# The floor plan: docs/architecture.md.
MAX_ENGINE_DEPTH = 10
ROOM_DEPTH = {"config": 1, "core": 4, "grammar": 4, "kernels": 4, "quantization": 1, "layers": 3,
              "loading": 4, "attention": 3, "models": 4, "lora": 4, "executor": 5,
              "speculative": 2, "runtime": 3}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT))


def load_modules() -> dict[str, Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            out[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = load_modules()


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imported_modules(module: Module,
                     node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None]]:
    """(module path, imported name or None) for each thing one import statement imports;
    relative imports resolved."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None
        return
    base = node.module or ""
    if node.level:
        package = module.name.split(".")
        if not module.is_package:
            package = package[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    for alias in node.names:
        yield base, alias.name


def dependencies(module: Module, modules: dict[str, Module]) -> set[str]:
    """The project modules `module` imports, wherever the import stands (rules 1 and 5)."""
    deps = set()
    for node in ast.walk(module.tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for path, name in imported_modules(module, node):
            target = f"{path}.{name}" if name and f"{path}.{name}" in modules else path
            while target and target not in modules:  # `import a.b.c` of a non-module c
                target = target.rpartition(".")[0]
            if target and target != module.name:
                deps.add(target)
    return deps


def import_cycles(modules: dict[str, Module] = MODULES) -> list[list[str]]:
    """Each group of modules that import each other (Tarjan's strongly connected
    components of more than one module), as one cycle through the group."""
    graph = {name: sorted(dependencies(m, modules)) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, set(g)) for g in groups]


def _cycle_through(graph: dict[str, list[str]], group: set[str]) -> list[str]:
    """A cycle from the group's first module back to itself, inside the group (for the
    message: 'a -> b -> a' says which imports to look at)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    return paths[v] + [start]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def own_private_names(module: Module) -> set[str]:
    """The underscore names `module` defines (rule 2)."""
    names = set()
    body_nodes = list(module.tree.body)
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ClassDef):
            body_nodes += node.body
    for node in body_nodes:  # module level and class bodies
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in ast.walk(module.tree):  # self._x = ... / cls._x = ... anywhere
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {n for n in names if is_private(n)}


def private_access(module: Module) -> list[str]:
    """Rule 2's violations in `module`, as 'file:line: what'."""
    own = own_private_names(module)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{module.where}:{node.lineno}: {what}")

    for node in ast.walk(module.tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for path, name in imported_modules(module, node):
                if any(is_private(p) for p in path.split(".")):
                    report(node, f"imports from private module {path}")
                elif name and is_private(name):
                    report(node, f"imports private {path}.{name}")
            continue
        attr = None
        if isinstance(node, ast.Attribute):
            attr, target = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            attr, target = node.args[1].value, node.args[0]
        if attr is None or not is_private(attr) or attr in own or attr in PUBLIC_UNDERSCORE:
            continue
        on = ast.unparse(target)
        if f"{on}.{attr}" in ALLOWED_PRIVATE:
            continue
        if on in ("self", "cls"):
            report(node, f"{on}.{attr}: inherited from a class defined in another module")
        else:
            report(node, f"{on}.{attr}: private to another module")
    return found


def engine_public_names() -> set[str]:
    """engine/__init__.py's `_EXPORTS` (name -> module, imported on first use): its
    `__all__` is the keys."""
    tree = MODULES["engine"].tree
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def layering(package: str) -> list[str]:
    """Rule 3's violations in one package."""
    public = engine_public_names()
    found = []
    for module in MODULES.values():
        if module.name.split(".")[0] != package:
            continue
        for node in ast.walk(module.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", 0):
                continue
            for path, name in imported_modules(module, node):
                top = path.split(".")[0]
                where = f"{module.where}:{node.lineno}"
                if package in ("engine", "frontend") and top in PACKAGES and top != package:
                    found.append(f"{where}: {package}/ imports {path}")
                elif package == "router" and not (top in ROUTER_MAY_IMPORT
                                                   or top in sys.stdlib_module_names):
                    found.append(f"{where}: router/ imports {path}")
                elif package == "deployments" and top == "engine" and (
                        path != "engine" or name not in public):
                    what = f"{path}.{name}" if name else path
                    found.append(f"{where}: deployments/ imports {what}, not exported by "
                                 "engine (add it to engine/__init__.py's __all__ if public)")
    return found


def room_of(name: str) -> str | None:
    """engine.<room>[.x] -> <room>; None for the engine package itself."""
    parts = name.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def room_violations(modules: dict[str, Module] = MODULES) -> list[str]:
    """Rule 4's violations: an engine module importing a room its own room may not."""
    found = []
    for module in modules.values():
        room = room_of(module.name)
        if room is None:
            continue
        allowed = ENGINE_ROOMS.get(room)
        if allowed is None:
            found.append(f"{module.where}: engine/{room} is not a known room (ENGINE_ROOMS)")
            continue
        for dep in dependencies(module, MODULES):
            other = room_of(dep)
            if dep == "engine" or (other is not None and other != room and other not in allowed):
                found.append(f"{module.where}: engine/{room} imports {dep}")
    return found


def floors(modules: dict[str, Module], within: str | None = None) -> dict[str, list[str]]:
    """Rule 5: each engine module's longest chain of imports, itself first (its
    floor is the chain's length: a module sits above everything it imports). `within` a
    room, only the imports inside that room count."""
    names = [n for n in modules if n.split(".")[0] == "engine"
             and (within is None or room_of(n) == within)]
    graph = {n: [d for d in dependencies(modules[n], modules) if d in names]
             for n in names}
    chains: dict[str, list[str]] = {}

    def chain(n: str) -> list[str]:
        if n not in chains:
            chains[n] = [n] + max((chain(d) for d in graph[n]), key=len, default=[])
        return chains[n]

    for n in names:
        chain(n)
    return chains


def too_deep(chains: dict[str, list[str]], limit: int) -> list[str]:
    deepest = max(chains.values(), key=len, default=[])
    return [f"{len(deepest)} floors: " + " -> ".join(deepest)] if len(deepest) > limit else []


# -- the tests --------------------------------------------------------------------------

def fake_modules(sources: dict[str, str]) -> dict[str, Module]:
    return {name: Module(name, ROOT / (name.replace(".", "/") + ".py"), ast.parse(src))
            for name, src in sources.items()}


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_access_across_modules(package):
    found = [line for m in MODULES.values()
             if m.name.split(".")[0] == package and m.name != RAY_ADAPTER
             for line in private_access(m)]
    assert not found, "private access across modules:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("package", ["engine", "router", "deployments", "frontend"])
def test_layering(package):
    found = layering(package)
    assert not found, "\n  ".join(["layering:"] + found)


def test_engine_rooms():
    found = room_violations()
    assert not found, "\n  ".join(["rooms:"] + found)


def test_the_room_checker_sees_violations():
    source = "from engine.executor.sampler import Sampler\nfrom engine.core.request import Request\n"
    fake = {"engine.core.fake": Module("engine.core.fake", ROOT / "engine/core/fake.py",
                                       ast.parse(source))}
    found = room_violations(fake)
    assert len(found) == 1 and "engine/core imports engine.executor.sampler" in found[0]


def test_the_checker_sees_violations():
    """The rules catch what they are for (a checker that never fails checks nothing)."""
    source = """
from ray.serve._private.common import RequestMetadata
from engine.core.request import validate_request
from engine import _hidden
import deployments.app

class Router(Base):
    def __init__(self):
        self._mine = 1
    def go(self, other):
        return self._mine + other._mine + self._inherited + other._theirs + getattr(other, "_x")
"""
    module = Module("deployments.fake", ROOT / "deployments" / "fake.py", ast.parse(source))
    found = "\n".join(private_access(module))
    for what in ("private module ray.serve._private.common", "imports private engine._hidden",
                 "self._inherited", "other._theirs", "other._x"):
        assert what in found
    assert "_mine" not in found
    assert dependencies(module, MODULES) >= {"engine.core.request", "engine", "deployments.app"}


def test_the_checker_sees_a_cycle():
    """Even through an import deferred into a function or under TYPE_CHECKING."""
    sources = {"pkg.a": "from pkg.b import f\n",
               "pkg.b": "def f():\n    from pkg import c\n",
               "pkg.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
               "pkg.d": "import pkg.a\n"}
    assert import_cycles(fake_modules(sources)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_engine_import_depth():
    found = too_deep(floors(MODULES), MAX_ENGINE_DEPTH)
    assert not found, f"engine/ deeper than {MAX_ENGINE_DEPTH} floors:\n  " + found[0]


@pytest.mark.parametrize("room", sorted(ENGINE_ROOMS))
def test_room_import_depth(room):
    assert room in ROOM_DEPTH, f"engine/{room} has no bound in ROOM_DEPTH"
    found = too_deep(floors(MODULES, within=room), ROOM_DEPTH[room])
    assert not found, f"engine/{room} deeper than {ROOM_DEPTH[room]} floors inside:\n  " + found[0]


def test_the_depth_checker_sees_a_chain():
    """Every import counts: inside a function, and under TYPE_CHECKING (either branch)."""
    fake = fake_modules({
        "engine.a.x": "from engine.a import y\n",
        "engine.a.y": "def f():\n    import engine.b.z\n",
        "engine.b.z": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.b.w\n",
        "engine.b.w": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\n"
                      "else:\n    import engine.b.v\n",
        "engine.b.v": ""})
    assert floors(fake)["engine.a.x"] == ["engine.a.x", "engine.a.y", "engine.b.z", "engine.b.w",
                                          "engine.b.v"]
    assert floors(fake, within="a")["engine.a.x"] == ["engine.a.x", "engine.a.y"]
    assert floors(fake, within="b")["engine.b.z"] == ["engine.b.z", "engine.b.w", "engine.b.v"]
    assert too_deep(floors(fake), 4) and not too_deep(floors(fake), 5)


def test_the_depth_checker_sees_a_type_import_up():
    """A low module that names a high one's class for its annotations sits above it: the
    chain through the type-only import is too deep, where a Protocol of the low module's
    own keeps it on the ground floor."""
    top = {"engine.r.engine": "from engine.r.loop import Loop\nfrom engine.r.base import B\n",
           "engine.r.loop": "from engine.r.base import B\n",
           "engine.r.base": ""}
    upward = fake_modules(top | {"engine.r.report": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from engine.r.engine import Engine\n")})
    assert floors(upward, within="r")["engine.r.report"] == [
        "engine.r.report", "engine.r.engine", "engine.r.loop", "engine.r.base"]
    assert too_deep(floors(upward, within="r"), 3)
    protocol = fake_modules(top | {"engine.r.report": (
        "from typing import Protocol\nclass Engine(Protocol):\n    def stats(self) -> dict: ...\n")})
    assert floors(protocol, within="r")["engine.r.report"] == ["engine.r.report"]
    assert not too_deep(floors(protocol, within="r"), 3)


MAX_FILE_LINES = 400  # a product file past this holds more than one concept: split it


def test_no_product_file_is_over_400_lines():
    files = [p for room in ("engine", "deployments", "router", "frontend")
             for p in (ROOT / room).rglob("*.py")]
    assert len(files) > 100
    long = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p in files
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES)
    assert not long, "\n".join(long)
