"""The layers point down: every import in nvmeof/, target/, initiator/ and api/ is read with `ast`.

    composition  nvmeof/cli/ (the click CLI, the daemon assembly) and nvmeof/__main__.py: may import anything
    api          core + target
    target       core only          initiator    core only          (never each other)
    core         nvmeof/ without the composition layer: standard and third-party libraries only

Module-level and function-level imports count alike (a lazy import is still an arrow), and so does
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name. Inside the initiator,
no two modules may import each other, directly or around a longer loop.

Nor does a module set an attribute on another object's instance (``obj.x = ...``, not ``self``/``cls``)
with ``# type: ignore``: an attribute the owner does not declare is an interface nobody can see; the
owner declares it (or offers a method), as Target does for peer_listeners and transport_state.

Inside the target: no module imports target.core but the ones that build a Target on it (the worker
processes' targets); the others name the Protocols of target/ports.py, so neither target.core nor the
gateway group is part of an import cycle, TYPE_CHECKING imports included. The gateway group drives the
service and the target through declared methods only: it sets no attribute of another object and probes
none with hasattr/getattr (an exception's optional fields aside).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nvmeof", "target", "initiator", "api")
COMPOSITION = ("nvmeof.cli", "nvmeof.__main__")   # `python3 -m nvmeof` is the CLI's entry point
ALLOWED = {
    "core": {"core"},
    "target": {"core", "target"},
    "initiator": {"core", "initiator"},
    "api": {"core", "target", "api"},
    "composition": {"core", "target", "initiator", "api", "composition"},
}


@dataclass(frozen=True)
class Arrow:
    path: str
    line: int
    source: str       # layer of the importing file
    module: str       # what it imports
    target: str       # layer of that

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target} (imports {self.module})"


def module_name(relpath: str) -> str:
    """``nvmeof/cli/__init__.py`` -> ``nvmeof.cli``; ``target/core.py`` -> ``target.core``."""
    parts = list(Path(relpath).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to; None for the standard and third-party libraries."""
    if any(module == c or module.startswith(c + ".") for c in COMPOSITION):
        return "composition"
    top = module.split(".", 1)[0]
    if top == "nvmeof":
        return "core"
    return top if top in PACKAGES else None


def _resolve(relpath: str, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``relpath``."""
    if not level:
        return module or ""
    package = module_name(relpath).split(".")
    if not relpath.endswith("__init__.py"):
        package.pop()
    base = package[:len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, module] if module else base)


def _import_call(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_of(source: str, relpath: str) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in ``source``, at any depth; ``from a import b`` gives a.b."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, relpath)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(relpath, node.level, node.module)
            found += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and (name := _import_call(node)) is not None:
            found.append((node.lineno, _resolve(relpath, 1, name[1:]) if name.startswith(".") else name))
    return found


def bad_arrows(source: str, relpath: str) -> list[Arrow]:
    """The imports of ``source`` (as if it were the file ``relpath``) that point up or sideways."""
    here = layer_of(module_name(relpath))
    assert here is not None, f"{relpath} is in no layer"
    bad = []
    for line, module in imports_of(source, relpath):
        there = layer_of(module)
        if there is not None and there not in ALLOWED[here]:
            bad.append(Arrow(relpath, line, here, module, there))
    return bad


def _sources(package: str) -> dict[str, str]:
    files = sorted((ROOT / package).rglob("*.py"))
    return {f.relative_to(ROOT).as_posix(): f.read_text() for f in files}


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """Cycles among the modules of ``sources`` (relpath -> text), each as the modules around it."""
    modules = {module_name(path): path for path in sources}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for _, name in imports_of(sources[path], path):
            # `from initiator import discovery` names a module, `from initiator import connect` the package
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != mod:
                graph[mod].add(name)
    return _strongly_connected(graph)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def undeclared_writes(source: str, path: str) -> list[str]:
    """``path:line: obj.attr`` for each assignment to another object's attribute silenced with # type: ignore."""
    # a bare ignore, or attr-defined: the attribute is not declared. [assignment] / [method-assign] on a declared
    # one (worker.py's RemoteController as queue.ctrl, FastAPI's documented app.openapi override) are typing
    # matters, not hidden interfaces.
    ignored = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
               if tok.type == tokenize.COMMENT and re.search(r"type:\s*ignore(?!\[)|type:\s*ignore\[[^]]*attr-defined",
                                                             tok.string)}
    return [f"{path}:{node.lineno}: {ast.unparse(t)}" for node, t in _foreign_targets(source)
            if ignored & set(range(node.lineno, (node.end_lineno or node.lineno) + 1))]


def _foreign_targets(source: str, tree: ast.AST | None = None) -> list[tuple[ast.stmt, ast.Attribute]]:
    """(assignment, target) for each attribute assigned in ``source`` that is not ``self``'s or ``cls``'s own."""
    found = []
    for node in ast.walk(tree if tree is not None else ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        found += [(node, t) for t in flat if isinstance(t, ast.Attribute)
                  and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))]
    return found


def core_imports(source: str, relpath: str) -> list[str]:
    """``path:line`` of each import of target.core (or a name from it) in ``source``, at any depth."""
    return [f"{relpath}:{line}" for line, module in imports_of(source, relpath)
            if module == "target.core" or module.startswith("target.core.")]


def foreign_writes(source: str, path: str) -> list[str]:
    """``path:line: target`` for each assignment to another object's state: a private attribute of anything
    but ``self``/``cls``, any attribute of an object reached through another (``self.service.gateway = ...``
    sets the service's state, ``self.x = ...`` the object's own), or of an object the function was given
    (a parameter). A local object the function made itself (``timer.daemon = True``) is its own business."""
    tree = ast.parse(source)
    params: dict[int, set[str]] = {}   # id of an assignment -> the parameters of the function it is in
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            names = {a.arg for a in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]}
            for node in ast.walk(func):
                params.setdefault(id(node), set()).update(names)
    found = []
    for node, t in _foreign_targets(source, tree):
        given = isinstance(t.value, ast.Name) and t.value.id in params.get(id(node), set())
        if t.attr.startswith("_") or isinstance(t.value, ast.Attribute | ast.Subscript | ast.Call) or given:
            found.append(f"{path}:{node.lineno}: {ast.unparse(t)}")
    return found


def attribute_probes(source: str, path: str) -> list[str]:
    """``path:line: call`` for each hasattr(), and each getattr() with a default, except on a caught exception
    (a third-party error's optional errno): a member that may be missing is an undeclared interface."""
    tree = ast.parse(source)
    caught = {node.name for node in ast.walk(tree) if isinstance(node, ast.ExceptHandler) and node.name}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
        on_exception = bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in caught
        if probe and not (node.func.id == "getattr" and on_exception):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


# --------------------------------------------------------------------------- the tree


def test_no_attribute_is_set_on_another_object_with_type_ignore() -> None:
    bad = [w for package in PACKAGES for path, text in _sources(package).items()
           for w in undeclared_writes(text, path)]
    assert not bad, "undeclared attributes set from outside (declare them on the owner):\n" + "\n".join(bad)


def test_layers_point_down() -> None:
    bad = [arrow for package in PACKAGES for path, text in _sources(package).items()
           for arrow in bad_arrows(text, path)]
    assert not bad, "imports that point up or sideways:\n" + "\n".join(map(str, bad))


def test_every_file_is_checked() -> None:
    # a package renamed or emptied would make the test above pass vacuously
    counts = {package: len(_sources(package)) for package in PACKAGES}
    assert all(n >= 5 for n in counts.values()), counts
    assert "nvmeof/cli/daemon.py" in _sources("nvmeof") and layer_of("nvmeof.cli.daemon") == "composition"


def _module_level_imports(source: str) -> list[str]:
    """Modules imported outside every function body (what importing the module itself pulls in)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_the_core_imports_pyverbs_only_when_rdma_is_used() -> None:
    # nvmeof/verbs.py is shared by both roles; load_pyverbs() imports pyverbs, so the core (and a TCP-only
    # target or host) imports without it
    eager = [path for path, text in _sources("nvmeof").items()
             if any(m.split(".")[0] == "pyverbs" for m in _module_level_imports(text))]
    assert not eager, f"module-level pyverbs imports in {eager}"
    assert _module_level_imports("import pyverbs.cq\ndef f():\n    import pyverbs.mr\n") == ["pyverbs.cq"]


# the modules that build a Target on target.core.Target (serve --workers): composition inside the target
TARGET_BUILDERS = ("target/core.py", "target/workers.py", "target/worker.py")


def test_the_target_core_names_ports_not_target_core() -> None:
    bad = [hit for path, text in _sources("target").items() if path not in TARGET_BUILDERS
           for hit in core_imports(text, path)]
    assert not bad, "imports of target.core (name a Protocol of target/ports.py instead):\n" + "\n".join(bad)


def test_neither_target_core_nor_the_gateway_group_is_in_an_import_cycle() -> None:
    cycles = [c for c in import_cycles(_sources("target"))
              if any(m == "target.core" or m.startswith("target.gateway.") for m in c)]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_gateway_group_uses_declared_interfaces_only() -> None:
    sources = {path: text for path, text in _sources("target").items() if path.startswith("target/gateway/")}
    assert len(sources) >= 5, sorted(sources)
    writes = [w for path, text in sources.items() for w in foreign_writes(text, path)]
    assert not writes, "attributes of other objects set from the gateway group:\n" + "\n".join(writes)
    probes = [p for path, text in sources.items() for p in attribute_probes(text, path)]
    assert not probes, "attribute probes in the gateway group (declare the member):\n" + "\n".join(probes)


# target/service/ (issue 27): the leaf, the ground, and the resource mixins that stand on both
SERVICE_GROUND = {"target.service.checks": set(), "target.service.base": {"target.service.checks"}}
SERVICE_MODULE_LINES = 400   # each module readable in one sitting


def test_the_service_resources_stand_on_base_and_checks_only() -> None:
    """Each resource module of the service (a mixin) imports base.py and checks.py only, never the facade
    (target/service/__init__.py) nor another resource: they meet in TargetService, through ``self``. checks.py
    imports nothing of the service."""
    sources = {path: text for path, text in _sources("target").items() if path.startswith("target/service/")}
    modules = {module_name(path) for path in sources}
    assert {"target.service", *SERVICE_GROUND} <= modules and len(modules) >= 10, sorted(modules)
    bad = []
    for path, text in sources.items():
        here = module_name(path)
        if here == "target.service":
            continue
        allowed = SERVICE_GROUND.get(here, set(SERVICE_GROUND))
        for line, name in imports_of(text, path):
            while name and name not in modules and name.startswith("target.service"):
                name = name.rpartition(".")[0]
            if name in modules and name not in allowed:
                bad.append(f"{path}:{line}: imports {name}")
    assert not bad, "service modules importing sideways or up:\n" + "\n".join(bad)
    long = [f"{path}: {len(text.splitlines())} lines" for path, text in sources.items()
            if len(text.splitlines()) > SERVICE_MODULE_LINES]
    assert not long, f"service modules over {SERVICE_MODULE_LINES} lines (split by resource):\n" + "\n".join(long)


def test_no_import_cycles_in_initiator() -> None:
    cycles = import_cycles(_sources("initiator"))
    assert not cycles, "initiator modules importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


# --------------------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(("source", "path", "arrow"), [
    ("from api.app import create_app", "nvmeof/tcp.py", "nvmeof/tcp.py:1: core -> api (imports api.app.create_app)"),
    ("from target.core import Target", "initiator/x.py",
     "initiator/x.py:1: initiator -> target (imports target.core.Target)"),
    ("import initiator.queue", "target/core.py", "target/core.py:1: target -> initiator (imports initiator.queue)"),
    ("from nvmeof import cli", "nvmeof/tcp.py", "nvmeof/tcp.py:1: core -> composition (imports nvmeof.cli)"),
    ("import nvmeof.cli.daemon", "api/app.py", "api/app.py:1: api -> composition (imports nvmeof.cli.daemon)"),
    ("from initiator import connect", "api/app.py", "api/app.py:1: api -> initiator (imports initiator.connect)"),
    ("def f():\n    if True:\n        from target import core\n", "nvmeof/rdma.py",
     "nvmeof/rdma.py:3: core -> target (imports target.core)"),
    ("from ..cli import daemon", "nvmeof/spec/nvme.py",
     "nvmeof/spec/nvme.py:1: core -> composition (imports nvmeof.cli.daemon)"),
    ("import importlib\nm = importlib.import_module('api.app')", "target/x.py",
     "target/x.py:2: target -> api (imports api.app)"),
    ("__import__('initiator')", "target/backends/x.py",
     "target/backends/x.py:1: target -> initiator (imports initiator)"),
])
def test_checker_catches_a_planted_upward_import(source: str, path: str, arrow: str) -> None:
    assert [str(a) for a in bad_arrows(source, path)] == [arrow]


@pytest.mark.parametrize(("source", "path"), [
    ("from target.core import Target\nfrom nvmeof import defaults", "api/app.py"),
    ("from api.app import create_app\nimport initiator\nfrom target.core import Target", "nvmeof/cli/daemon.py"),
    ("from nvmeof.cli import main", "nvmeof/__main__.py"),
    ("from . import verbs\nfrom .spec import nvme\nimport asyncio, construct", "nvmeof/rdma.py"),
    ("from .common import parse_size", "nvmeof/cli/commands/serve.py"),
    ("from initiator.queue import HostQueue", "initiator/rdma.py"),
])
def test_checker_allows_downward_imports(source: str, path: str) -> None:
    assert bad_arrows(source, path) == []


def test_cycle_checker_catches_a_planted_cycle() -> None:
    sources = {
        "initiator/__init__.py": "from initiator.a import x\n",
        "initiator/a.py": "from initiator.b import y\n",
        "initiator/b.py": "def f():\n    from initiator.c import z\n",       # lazy: still an arrow
        "initiator/c.py": "from initiator import a\n",
        "initiator/d.py": "from initiator import x\nfrom initiator.a import x\n",  # imports, is not imported
    }
    assert import_cycles(sources) == [["initiator.a", "initiator.b", "initiator.c"]]


@pytest.mark.parametrize(("source", "found"), [
    ("target.peer_listeners = peers  # type: ignore[attr-defined]\n", ["m.py:1: target.peer_listeners"]),
    ("def f(h):\n    h._ours = True  # type: ignore\n", ["m.py:2: h._ours"]),
    ("a.b.c, x = (\n    1, 2)  # type: ignore\n", ["m.py:1: a.b.c"]),
    ("obj.n += 1  # type: ignore[attr-defined]\n", ["m.py:1: obj.n"]),
    ("self.x = 1  # type: ignore\ncls.y = 2  # type: ignore\n", []),     # the owner itself
    ("obj.declared = 1\n", []),                                            # nothing silenced
    ("queue.ctrl = remote  # type: ignore[assignment]\n", []),             # declared, another type
    ("x = obj.attr  # type: ignore\n", []),                               # a read
])
def test_undeclared_write_checker(source: str, found: list[str]) -> None:
    assert undeclared_writes(source, "m.py") == found


@pytest.mark.parametrize(("source", "path", "found"), [
    ("if TYPE_CHECKING:\n    from target.core import Target\n", "target/pr.py", ["target/pr.py:2"]),
    ("def f():\n    from target import core\n", "target/auth.py", ["target/auth.py:2"]),
    ("from ..core import PSDT_MASK\n", "target/transports/tcp.py", ["target/transports/tcp.py:1"]),
    ("from target.ports import ControllerHost\nfrom target.controller import Controller\n", "target/fabrics.py", []),
])
def test_core_import_checker(source: str, path: str, found: list[str]) -> None:
    assert core_imports(source, path) == found


@pytest.mark.parametrize(("source", "found"), [
    ("self.service.gateway = self\n", ["m.py:1: self.service.gateway"]),
    ("self.service.target.pr_store = store\n", ["m.py:1: self.service.target.pr_store"]),
    ("group._ready, self.x = True, 1\n", ["m.py:1: group._ready"]),
    ("fence.group.owned |= {1}\n", ["m.py:1: fence.group.owned"]),
    ("self.owned = set()\ncls.n: int = 0\nx = self.service.gateway\n", []),
    ("def f(service, x):\n    service.gateway = x\n", ["m.py:2: service.gateway"]),
    ("def f():\n    timer = Timer(1, g)\n    timer.daemon = True\n", []),       # its own object
    ("def f(store):\n    store.handle()._open = 1\n", ["m.py:2: store.handle()._open"]),
])
def test_foreign_write_checker(source: str, found: list[str]) -> None:
    assert foreign_writes(source, "m.py") == found


@pytest.mark.parametrize(("source", "found"), [
    ("x = f(t) if hasattr(t, 'server') else None\n", ["m.py:1: hasattr(t, 'server')"]),
    ("port = getattr(server, 'port', None)\n", ["m.py:1: getattr(server, 'port', None)"]),
    ("try:\n    f()\nexcept OSError as exc:\n    n = getattr(exc, 'errno', None)\n", []),
    ("v = getattr(obj, name)\n", []),
])
def test_attribute_probe_checker(source: str, found: list[str]) -> None:
    assert attribute_probes(source, "m.py") == found
