"""The layout in docs/architecture.md, kept true: every import of every module (lazy ones in
functions included) points the way the picture's arrows allow, and no import cycle exists."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("vault", "tiers", "mirror", "cli")

# Leaf modules every package may use: they import only each other.
FOUNDATION = (
    "vault.errors",
    "vault.digest",
    "vault.files",
    "vault.canonical",
    "vault.config",
    # The bounded HTTP server under the vault's HTTP endpoints and the Kubernetes webhook.
    "vault.http_edge",
    "vault.sql",
    # Requests to an object store that the vault presigns, sent by clients and mirrors alike.
    "vault.presigned",
)
# The ledger's storage; the rest of vault.ledger is pure verification on bytes.
LEDGER_STORAGE = ("vault.ledger.db", "vault.ledger.log", "vault.ledger.tiles")
# The parts of the content store a client-side caller may use: dataset manifests, what an
# image's manifest names, the cache of file digests, and the allocator tuning of a process that
# moves large blobs.
STORE_FOR_CLIENTS = (
    "vault.store.manifest",
    "vault.store.image",
    "vault.store.hashcache",
    "vault.store.allocator",
)
# The commands that run on the vault's own host with its configuration: the only ones that
# open the server's stores.
HOST_COMMANDS = ("cli.serve", "cli.tier", "cli.mirror", "cli.gc")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p.rstrip(".") or module.startswith(p.rstrip(".") + ".") for p in prefixes)


def allowed(importer: str, imported: str) -> bool:
    """Whether the arrow importer -> imported is in the picture."""
    if _within(importer, FOUNDATION):
        return _within(imported, FOUNDATION)
    if _within(imported, FOUNDATION):
        return True
    if _within(imported, ("vault.wire",)):
        return _within(importer, ("vault.wire", "vault.client", "vault.server"))
    ledger_pure = _within(imported, ("vault.ledger",)) and not _within(imported, LEDGER_STORAGE)
    if _within(importer, ("vault.ledger",)):
        return _within(imported, ("vault.ledger",))
    if _within(importer, ("vault.store",)):
        return _within(imported, ("vault.store",))
    if _within(importer, ("vault.client",)):
        return _within(imported, ("vault.client",)) or ledger_pure
    if _within(importer, ("vault.runs",)):
        return _within(imported, ("vault.runs", "vault.client", *STORE_FOR_CLIENTS)) or ledger_pure
    if _within(importer, ("vault.server",)):
        return _within(imported, ("vault.server", "vault.ledger", "vault.store", "tiers", "mirror"))
    if _within(importer, ("tiers",)):
        return _within(imported, ("tiers", "vault.store"))
    if _within(importer, ("mirror",)):
        return _within(imported, ("mirror", "tiers", "vault.store"))
    if _within(importer, ("cli",)):
        client_side = (
            _within(imported, ("cli", "vault.client", "vault.runs", *STORE_FOR_CLIENTS))
            or ledger_pure
        )
        if _within(importer, HOST_COMMANDS):
            return client_side or _within(imported, ("vault.server", "vault.store"))
        return client_side
    return False


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str
    # Under `if TYPE_CHECKING:`: an annotation's name, never run. Such an import must still
    # point an allowed way, but a module may name in its annotations one that imports it.
    typing_only: bool = False


_TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "wire" in path.relative_to(ROOT).parts[:2]:
                continue
            found[_module_name(path)] = path
    return found


def _imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module, at any depth of the file (lazy imports count)."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in _TYPE_CHECKING
            for statement in node.body
            for inner in ast.walk(statement)
        }
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    # `from package import module` imports the module itself.
                    submodule = f"{node.module}.{alias.name}"
                    is_module = submodule in modules or submodule.startswith("vault.wire.")
                    targets.append(submodule if is_module else node.module)
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            found += [
                Import(name, target, where, id(node) in typing_only)
                for target in targets
                if target.split(".")[0] in PACKAGES
            ]
    return found


def test_every_import_points_the_way_the_architecture_allows() -> None:
    wrong = sorted(
        {
            f"{i.where}: {i.importer} imports {i.imported}"
            for i in _imports(_modules())
            if i.importer != i.imported and not allowed(i.importer, i.imported)
        }
    )
    assert not wrong, "imports that break docs/architecture.md:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for i in _imports(modules):
        if i.imported in modules and i.imported != i.importer and not i.typing_only:
            edges[i.importer].add(i.imported)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_rules_refuse_what_the_picture_forbids() -> None:
    # The checker itself: arrows the picture forbids are refused, so the tests above can fail.
    assert not allowed("vault.ledger.merkle", "vault.server.service")
    assert not allowed("vault.ledger.entry", "vault.store.protocol")
    assert not allowed("vault.store.protocol", "vault.ledger.entry")
    assert not allowed("vault.client.client", "vault.server.auth")
    assert not allowed("vault.client.client", "vault.ledger.db")
    assert not allowed("vault.client.client", "vault.ledger.tiles")
    assert not allowed("vault.runs.run", "vault.server.admission")
    assert not allowed("vault.runs.run", "tiers.hot")
    assert not allowed("tiers.hot", "mirror.queue")
    assert not allowed("tiers.hot", "vault.ledger.entry")
    assert not allowed("cli.run", "vault.server.service")
    assert not allowed("vault.errors", "vault.client")
    assert allowed("cli.serve", "vault.server.service")
    assert not allowed("vault.client.client", "vault.server.metrics")
    assert not allowed("tiers.scrub", "vault.server.metrics")
    assert allowed("vault.server.admission", "vault.ledger.log")
    assert allowed("mirror.queue", "tiers.manager")
    assert allowed("cli.k8s_webhook", "vault.http_edge")
    assert allowed("vault.server.tiles_http", "vault.http_edge")
    assert not allowed("vault.http_edge", "vault.server.http_endpoint")


def loaded_by(module: str, packages: tuple[str, ...], prefixes: tuple[str, ...]) -> list[str]:
    """The modules a fresh interpreter has loaded after importing `module` that are in one of
    `packages` (by their first name) or start with one of `prefixes`."""
    probe = (
        f"import sys, {module}\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r} "
        f"or m.startswith({prefixes!r}))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return result.stdout.split()


@pytest.mark.parametrize(
    "module", ["vault.runs", "vault.runs.fs", "vault.client", "vault.ledger.audit"]
)
def test_a_client_side_import_pulls_in_no_server_code(module: str) -> None:
    """A researcher's script that imports the run library or the client loads none of the
    server, the tiers, the mirrors or the ledger's storage."""
    server = ("vault.server", "vault.ledger.db", "vault.ledger.log", "vault.ledger.tiles")
    bad = loaded_by(module, ("tiers", "mirror", "sqlalchemy", "prometheus_client"), server)
    assert bad == [], f"importing {module} loads {' '.join(bad)}"


def test_the_audit_s_workers_load_no_signature_code() -> None:
    """`vault verify` starts a worker process a core for its chunks of rows; a worker checks
    hashes and entries only, so it does not pay for loading the signature code."""
    bad = loaded_by("vault.ledger.audit", ("cryptography",), ("vault.ledger.checkpoint",))
    assert bad == [], f"the audit loads {' '.join(bad)}"
