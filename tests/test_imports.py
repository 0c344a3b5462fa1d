"""The import graph of smstore as a test: no import loops, and CONTRIBUTING's layering table held.

Every module of ``smstore/`` is parsed (not imported), so an import written inside a function, under
``if TYPE_CHECKING:``, as ``importlib.import_module("smstore.x")`` or in a package's ``_LAZY`` table
counts as much as one at the top of a file. The table in CONTRIBUTING.md ("Where things live") is
read from the markdown, so the documentation and this test cannot drift apart.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import smstore_testlib as tl

import smstore

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "smstore"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"

# Every module may import the exception hierarchy (the table's header says so).
EVERYONE_MAY_IMPORT = "smstore.errors"
# What a DataLoader worker (or a rank's training loop) imports: readers, samplers, views, lists.
WORKER_SIDE = (
    "smstore.read.dataset",
    "smstore.loading.collate",
    "smstore.sampling",
    "smstore.read.views",
    "smstore.read.shared_list",
    "smstore.wire.residency",
    "smstore.wire.client",
    "smstore.read.store",
    "smstore.integrations.mmengine",
    "smstore.loading.transform_loader",  # its workers run _worker_main
)
# The daemon, its segment and connection bookkeeping, and the command line: never reached by a worker.
SERVER_SIDE_PREFIXES = ("smstore.daemon", "smstore.cli")


@dataclass(frozen=True)
class Edge:
    """``src`` imports ``dst`` at ``line``; ``how`` is where: module, function, type-checking or lazy."""

    src: str
    dst: str
    line: int
    how: str

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({module_file(self.src)}:{self.line}, {self.how})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules() -> dict[str, Path]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules["smstore._core"] = PACKAGE / "_core.pyi"  # the compiled module, known by its stub
    return modules


MODULES = find_modules()


def module_file(name: str) -> str:
    return os.fspath(MODULES[name].relative_to(ROOT))


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(name: str) -> str | None:
    """The smstore module that importing ``name`` loads: its longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def parents(name: str) -> Iterator[str]:
    """The packages Python imports before ``name`` (``smstore`` for ``smstore.x``)."""
    parts = name.split(".")[:-1]
    while parts:
        yield ".".join(parts)
        parts.pop()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.package = module if is_package(module) else module.rpartition(".")[0]
        self.where = ["module"]
        self.edges: list[Edge] = []

    def _add(self, target: str, line: int, how: str | None = None) -> None:
        dst = resolve(target)
        if dst is not None and dst != self.module:
            self.edges.append(Edge(self.module, dst, line, how or self.where[-1]))

    def _nested(self, node: ast.AST, where: str) -> None:
        self.where.append(where)
        self.generic_visit(node)
        self.where.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._nested(node, "type-checking" if self.where[-1] == "type-checking" else "function")

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._nested(node, "type-checking" if self.where[-1] == "type-checking" else "function")

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._nested(node, "function")

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.where.append("type-checking")
        for child in node.body:
            self.visit(child)
        self.where.pop()
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base_parts = self.package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            # `from smstore import _core` imports the module smstore._core; `from smstore.write.pack
            # import Writer` imports smstore.write.pack.
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in MODULES else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._add(first.value, node.lineno)
        self.generic_visit(node)

    def _lazy_table(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name) and target.id == "_LAZY" and isinstance(value, ast.Dict):
            for item in value.values:
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    self._add(item.value, item.lineno, "lazy")

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._lazy_table(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._lazy_table(node.target, node.value)
        self.generic_visit(node)


def imports_of(module: str) -> list[Edge]:
    path = MODULES[module]
    if path.suffix == ".pyi":
        return []
    visitor = _ImportVisitor(module)
    visitor.visit(ast.parse(path.read_text(), filename=os.fspath(path)))
    return visitor.edges


def third_party_imports(module: str) -> set[str]:
    """Top-level names of what ``module`` imports outside smstore, at any level of the file."""
    path = MODULES[module]
    if path.suffix == ".pyi":
        return set()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    found.discard("smstore")
    return found


EDGES = [edge for module in sorted(MODULES) for edge in imports_of(module)]


def graph(edges: Iterable[Edge]) -> dict[str, list[Edge]]:
    out: dict[str, list[Edge]] = {m: [] for m in MODULES}
    for edge in edges:
        out[edge.src].append(edge)
    return out


def find_cycle(edges: Iterable[Edge]) -> list[Edge] | None:
    """One import loop as its edges, or None: a depth-first search for an edge back onto the path."""
    out = graph(edges)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Edge] = []

    def visit(node: str) -> list[Edge] | None:
        state[node] = 1
        for edge in out[node]:
            if state.get(edge.dst) == 1:
                start = next((i for i, e in enumerate(path) if e.src == edge.dst), len(path))
                return [*path[start:], edge]
            if edge.dst not in state:
                path.append(edge)
                found = visit(edge.dst)
                if found:
                    return found
                path.pop()
        state[node] = 2
        return None

    for node in sorted(out):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def loaded_by(start: str, hows: tuple[str, ...]) -> dict[str, list[Edge]]:
    """Every smstore module that importing ``start`` (and calling into it) can load, with the chain
    of imports that gets there. Packages count: importing ``smstore.x`` runs ``smstore/__init__.py``
    first. ``hows`` says which edges to follow."""
    out = graph(e for e in EDGES if e.how in hows)
    chains: dict[str, list[Edge]] = {start: []}
    todo = [start]
    while todo:
        node = todo.pop()
        nexts = [*out[node], *(Edge(node, p, 0, "parent package") for p in parents(node))]
        for edge in nexts:
            if edge.dst not in chains:
                chains[edge.dst] = [*chains[node], edge]
                todo.append(edge.dst)
    return chains


def describe(chain: list[Edge]) -> str:
    return "\n  ".join(str(e) for e in chain) or "(itself)"


# --- The layering table of CONTRIBUTING.md -------------------------------------------------------


@dataclass
class Room:
    cell: str
    modules: set[str]
    may_import: set[str]


def doc_modules(path: str) -> set[str]:
    """The modules a path of the table names, relative to ``smstore/``: ``_pack.py`` or ``_core`` (one
    module), ``__init__.py`` (the package ``smstore``), ``convert/`` (a package and all under it)."""
    subtree = path.endswith("/")
    stem = path.rstrip("/").removesuffix(".pyi").removesuffix(".py")
    parts = ["smstore", *(p for p in stem.split("/") if p)]
    if parts[-1] == "__init__":
        parts.pop()
    name = ".".join(parts)
    assert name in MODULES, f"CONTRIBUTING's table names {path!r}, which is not a module of smstore"
    return {m for m in MODULES if m == name or (subtree and m.startswith(name + "."))}


@functools.cache
def layering_table() -> list[Room]:
    """The rows of CONTRIBUTING's "Where things live" that hold modules of smstore.

    A room is a list of paths: ``smstore/...`` starts one, and a bare file name after it is in the
    same folder (```smstore/read/store.py`, `_decode.py```). The "may import" column names modules
    relative to ``smstore/`` in backquotes; the rest of its text (libraries) is prose.
    """
    text = CONTRIBUTING.read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[0] == "room", header
    column = next(i for i, c in enumerate(header) if c.startswith("may import"))
    assert f"`{EVERYONE_MAY_IMPORT.removeprefix('smstore.')}`" in header[column], (
        f"CONTRIBUTING's table header should say every module may import `errors`: {header[column]!r}"
    )
    rooms = []
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        folder: str | None = None  # inside smstore/, or None: not a room of the package
        modules: set[str] = set()
        for token in re.findall(r"`([^`]+)`", cells[0]):
            if token.startswith("smstore/"):
                path = token.removeprefix("smstore/")
                folder = path[: path.rstrip("/").rfind("/") + 1]
            elif folder is None or "/" in token.rstrip("/"):
                folder = None  # csrc/..., tests/: not modules of the package
                continue
            else:
                path = folder + token
            modules |= doc_modules(path)
        if modules:
            may_import = {m for token in re.findall(r"`([^`]+)`", cells[column]) for m in doc_modules(token)}
            rooms.append(Room(cells[0], modules, may_import))
    return rooms


# --- The tests -----------------------------------------------------------------------------------


def test_the_parser_sees_every_kind_of_import() -> None:
    """The graph is only as good as its parser: each way this package imports itself is found."""
    kinds = {(e.src, e.dst, e.how) for e in EDGES}
    assert (
        "smstore.read.dataset",
        "smstore.wire.client",
        "module",
    ) in kinds  # from smstore.wire.client import ...
    assert any(  # inside `serve` (smstore.daemon, a module or a package)
        src == "smstore.cli.node"
        and _server_side(dst)
        and dst.startswith("smstore.daemon")
        and how == "function"
        for src, dst, how in kinds
    )
    assert ("smstore", "smstore.read.dataset", "lazy") in kinds  # the _LAZY table
    assert ("smstore", "smstore.read.dataset", "type-checking") in kinds  # if TYPE_CHECKING:
    assert ("smstore.convert", "smstore.convert.arrow", "lazy") in kinds
    assert ("smstore.read.store", "smstore._core", "module") in kinds  # from smstore import _core
    assert ("smstore.cli.data", "smstore.convert", "function") in kinds  # from smstore import convert
    assert ("smstore.cli", "smstore", "module") in kinds  # import smstore
    visitor = _ImportVisitor("smstore.read.views")
    visitor.visit(
        ast.parse(
            "import importlib\n"
            "from . import store\n"
            "from .shards import MANIFEST_NAME\n"
            "def f():\n"
            "    importlib.import_module('smstore.daemon')\n"
            "    from ..convert import arrow\n"
        )
    )
    assert [(e.dst, e.how) for e in visitor.edges] == [
        ("smstore.read.store", "module"),
        ("smstore.read.shards", "module"),
        ("smstore.daemon", "function"),
        ("smstore.convert.arrow", "function"),
    ]


def test_no_import_loops() -> None:
    """No module imports itself back through others, at module level, in a function, for type
    checking or through a lazy table: a loop hidden behind a function-level import is still a loop."""
    cycle = find_cycle(EDGES)
    assert cycle is None, "import loop:\n  " + "\n  ".join(str(e) for e in cycle or [])


def test_find_cycle_reports_the_loop() -> None:
    edges = [
        Edge("smstore.write.pack", "smstore.read.shards", 1, "function"),
        Edge("smstore.read.shards", "smstore.format.objects", 2, "module"),
        Edge("smstore.format.objects", "smstore.write.pack", 3, "module"),
        Edge("smstore.read.views", "smstore.write.pack", 4, "module"),
    ]
    cycle = find_cycle(edges)
    assert cycle is not None
    assert [e.src for e in cycle] == ["smstore.format.objects", "smstore.write.pack", "smstore.read.shards"]
    assert find_cycle(edges[1:]) is None


def test_every_module_has_a_row_in_the_layering_table() -> None:
    listed = {m for room in layering_table() for m in room.modules}
    missing = sorted(set(MODULES) - listed)
    assert not missing, f"modules with no row in CONTRIBUTING.md's 'Where things live': {missing}"
    twice = sorted(m for m in listed if sum(m in room.modules for room in layering_table()) > 1)
    assert not twice, f"modules in two rows of CONTRIBUTING.md's table: {twice}"


def test_imports_follow_the_layering_table() -> None:
    """Each module imports only its own room, the rooms its row says it may, and `errors`."""
    wrong = []
    for room in layering_table():
        allowed = room.modules | room.may_import | {EVERYONE_MAY_IMPORT}
        wrong += [
            f"{e}\n    row {room.cell} may import only: {sorted(room.may_import)}"
            for e in EDGES
            if e.src in room.modules and e.dst not in allowed
        ]
    assert not wrong, "imports CONTRIBUTING.md's table does not allow:\n  " + "\n  ".join(wrong)


# The compiled module's names that start with "_" are the package's, not the user's: _core is
# private to smstore as a whole, and these two are used across it (checked by stubtest).
CORE_PRIVATE_USED_BY_THE_PACKAGE = {"smstore._core._DataExport", "smstore._core.Store._from_fd"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reach_ins(module: str, source: str | None = None) -> list[str]:
    """``from smstore.x import _name`` and ``x._name`` (x an imported smstore module) in ``module``
    (or in ``source`` as if it were that module), where ``_name`` is not a module: another
    module's private names, used from outside."""
    if source is None:
        if MODULES[module].suffix == ".pyi":
            return []
        source = MODULES[module].read_text()
    tree = ast.parse(source)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> the smstore module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "smstore":
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else "smstore"
        elif (
            isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("smstore")
        ):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target in MODULES:
                    aliases[alias.asname or alias.name] = target
                elif (
                    _private(alias.name)
                    and node.module != module
                    and target not in CORE_PRIVATE_USED_BY_THE_PACKAGE
                ):
                    found.append(
                        f"{module_file(module)}:{node.lineno}: from {node.module} import {alias.name}"
                    )
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            continue
        dotted = aliases[value.id]
        for attr in chain:
            dotted = f"{dotted}.{attr}"
            if dotted in MODULES:
                continue
            if _private(attr) and dotted not in CORE_PRIVATE_USED_BY_THE_PACKAGE:
                found.append(f"{module_file(module)}:{node.lineno}: {dotted}")
            break
    return sorted(set(found))


def test_no_private_names_of_other_modules() -> None:
    """A module uses another's public names only: no ``_ipc._LEN``, ``from smstore.sampling import
    _round_keys``; what another module needs gets a name without the underscore (or a method)."""
    found = [line for module in sorted(MODULES) for line in private_reach_ins(module)]
    assert not found, "private names used from another module:\n  " + "\n  ".join(found)


def test_private_reach_ins_are_found() -> None:
    assert private_reach_ins("smstore.read.dataset") == []
    module = "smstore.read.views"
    source = (
        "import smstore\n"
        "from smstore import _core\n"
        "from smstore.wire import ipc as _ipc\n"
        "from smstore.sampling import _round_keys, GlobalShuffleSampler\n"
        "x = _ipc._LEN, smstore._core.Store._from_fd, _core._DataExport, smstore.wire.ipc.encode\n"
    )
    found = private_reach_ins(module, source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "from smstore.sampling import _round_keys",
        "smstore.wire.ipc._LEN",
    ]


def _server_side(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in SERVER_SIDE_PREFIXES)


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_workers_never_reach_the_daemon(module: str) -> None:
    """Nothing a DataLoader worker or a rank imports, nor anything those call, loads the daemon,
    its segment or connection bookkeeping, or the CLI (function-level imports included)."""
    assert module in MODULES
    chains = loaded_by(module, ("module", "function"))
    bad = {m: chain for m, chain in chains.items() if _server_side(m)}
    assert not bad, "\n".join(f"{module} reaches {m}:\n  {describe(c)}" for m, c in bad.items())


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _server_side(m)))
def test_the_server_side_never_reaches_torch(module: str) -> None:
    """The CLI and the daemon, and whatever they call, never import torch (a module that imports
    it anywhere, even inside a function, counts)."""
    chains = loaded_by(module, ("module", "function"))
    bad = {m: chain for m, chain in chains.items() if "torch" in third_party_imports(m)}
    assert not bad, "\n".join(
        f"{module} reaches {m}, which imports torch:\n  {describe(c)}" for m, c in bad.items()
    )


def test_the_cli_imports_the_daemon_only_in_its_commands() -> None:
    chains = loaded_by("smstore.cli", ("module",))
    bad = {
        m: chain for m, chain in chains.items() if _server_side(m) and m.split(".")[:2] != ["smstore", "cli"]
    }
    assert not bad, "\n".join(f"import smstore.cli loads {m}:\n  {describe(c)}" for m, c in bad.items())


def _python(code: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_worker_reading_a_record_has_not_loaded_the_daemon(tmp_path: Path) -> None:
    blob = tmp_path / "data.smst"
    smstore.pack([b"first", b"second"], blob, durable=False)
    code = (
        "import sys\n"
        "from smstore.read.dataset import SharedStoreDataset\n"
        "ds = SharedStoreDataset(sys.argv[1], mode='mmap')\n"
        "print(bytes(ds[1]).decode())\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('smstore'))))\n"
    )
    record, loaded = _python(code, os.fspath(blob)).splitlines()
    assert record == "second"
    assert "smstore.read.dataset" in loaded.split()
    assert [m for m in loaded.split() if _server_side(m)] == []


def test_importing_the_cli_imports_no_torch() -> None:
    code = "import sys, smstore.cli; print('torch' in sys.modules, 'smstore.daemon' in sys.modules)"
    assert _python(code).split() == ["False", "False"]


def test_no_python_module_creates_or_seals_a_segment() -> None:
    """Segments are the core's (issue 37): shm_create/shm_seal for the daemon's, memfd_create/memfd_seal
    for SharedList's, memfd_sealed for the one "never changes" check; no module of the package
    creates, seals or reads the seals of one with os or fcntl."""
    found = []
    for module, path in sorted(MODULES.items()):
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner, attr = node.value.id, node.attr
                if (owner == "os" and attr in ("memfd_create", "shm_open")) or (
                    owner == "fcntl" and "SEAL" in attr
                ):
                    found.append(f"{module}:{node.lineno}: {owner}.{attr}")
    assert not found, "segments made in Python, not by the core:\n  " + "\n  ".join(found)


def _url_checks() -> list[str]:
    """Every call of the URL predicate (`is_remote_url`) or of the one decision behind it (`source_of`)
    in smstore/, as "file:line", found in the parsed source (calls only, not their definitions or imports)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), os.fspath(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name in ("is_remote_url", "source_of"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_where_a_string_is_a_url_is_asked_in_few_places() -> None:
    """Issue 37: storage is decided once, where a user's or a request's string enters; everything
    after carries the decision (a `Source`, a protocol `Location`). The daemon asks in 2 places (the
    protocol's parse of a request, and `Source` for the names no request gave)."""
    daemon = [c for c in _url_checks() if c.startswith(("smstore/daemon/", "smstore/wire/protocol.py"))]
    assert len(daemon) <= 2, daemon


def test_the_package_asks_whether_a_string_is_a_url_at_most_10_times() -> None:
    """Issue 37's acceptance: `is_url(`-style checks at <= 10 call sites in the package: where user
    strings enter (smstore.open, open_store, the manifest's reader, one for every command's
    argument: cli/common.py) and the daemon's two."""
    checks = _url_checks()
    assert len(checks) <= 10, checks


def test_url_checks_are_found() -> None:
    assert any(c.startswith("smstore/daemon/sources.py:") for c in _url_checks())


def test_token_windows_in_stored_order_import_no_torch(tmp_path: Path) -> None:
    """A data-only process (a converter, a tokenizer job) reads TokenWindows without torch: the
    Feistel order of a shuffled epoch is imported only when one is asked for."""
    blob = tmp_path / "tokens.smst"
    smstore.pack_arrays([np.arange(1, 9, dtype=np.uint16)], blob, durable=False)
    code = (
        "import sys\n"
        "from smstore.read.tokens import TokenWindows\n"
        "w = TokenWindows(sys.argv[1], 3, eod=0)\n"
        "print(w[1].tolist(), 'torch' in sys.modules)\n"
    )
    assert _python(code, os.fspath(blob)).strip() == "[4, 5, 6, 7] False"
