"""docs/python.md, kept true: every ```python block of the guide runs, in order, as one session
in an empty folder, against a real `vault serve`, with the environment variables the guide says
its examples read. An example that raises fails the test, naming the block."""

from __future__ import annotations

import inspect
import re
import traceback
from pathlib import Path
from typing import Any

import pytest

import vault.client
import vault.runs
from tests.services.vault_server import REPO_ROOT, VaultServer

GUIDE = REPO_ROOT / "docs" / "python.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[int, str]]:
    """Each ```python block of the guide, with the line it starts on."""
    text = GUIDE.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def environment(server: VaultServer, home: Path) -> dict[str, str]:
    return {
        "PINVAULT_CLIENT_SERVER": server.address,
        "XDG_STATE_HOME": str(home / "state"),
        "XDG_CACHE_HOME": str(home / "cache"),
    }


def test_the_guide_documents_the_variables_its_examples_read(tmp_path: Path) -> None:
    text = GUIDE.read_text()
    for name in environment(VaultServer(tmp_path), tmp_path):
        assert f"| `{name}` |" in text, f"docs/python.md does not document {name}"


def test_every_example_of_the_guide_runs(
    vault_server: VaultServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    found = blocks()
    assert len(found) >= 10, f"docs/python.md has {len(found)} python blocks"
    for name, value in environment(vault_server, tmp_path).items():
        monkeypatch.setenv(name, value)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    session: dict[str, Any] = {"__name__": "__guide__"}
    for line, source in found:
        code = compile(source, f"{GUIDE}:{line}", "exec")
        try:
            exec(code, session)
        except BaseException as exc:
            pytest.fail(
                f"the example at docs/python.md line {line} raised "
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                pytrace=False,
            )


def public_api() -> list[tuple[str, object]]:
    """Every public class and function of `vault.client` and `vault.runs` defined there, and
    the public methods and properties each class defines."""
    found: list[tuple[str, object]] = []
    for package in (vault.client, vault.runs):
        for name in package.__all__:
            obj = getattr(package, name)
            if not obj.__module__.startswith(package.__name__):
                continue
            found.append((f"{package.__name__}.{name}", obj))
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if not member.startswith("_") and (
                        inspect.isfunction(value) or isinstance(value, (property, classmethod))
                    ):
                        found.append((f"{package.__name__}.{name}.{member}", getattr(obj, member)))
    return found


def test_the_public_api_is_documented() -> None:
    api = public_api()
    assert len(api) > 40
    bare = [name for name, obj in api if not inspect.getdoc(obj)]
    assert bare == [], f"public names without a docstring: {', '.join(bare)}"
