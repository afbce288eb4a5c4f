"""`--json` is one documented shape a command (docs/cli-json.md): every command that reports
something takes it, the document has a row for each, and what each command prints, run against
a real `vault serve`, has exactly the keys its row names."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.main import build_parser
from tests.services.vault_server import REPO_ROOT, VaultServer

DOC = REPO_ROOT / "docs" / "cli-json.md"
# Servers run until stopped: they print no report.
SERVERS = {"serve", "admission-agent", "k8s-webhook"}


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[str]:
    """Every command line that runs something: `vault run` itself and `vault run export`."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not any(group.required for group in groups):
        yield " ".join(words)
    for group in groups:
        for name, sub in group.choices.items():
            yield from commands(sub, (*words, name))


def takes_json(words: str) -> bool:
    parser = build_parser()
    for word in words.split():
        (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = group.choices[word]
    return any("--json" in a.option_strings for a in parser._actions)


def _without_parentheses(text: str) -> str:
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    return text


def _named_shapes(doc: str) -> dict[str, set[str]]:
    """The shapes the document defines once (an entry, a proven entry, an admission)."""
    shapes: dict[str, set[str]] = {}
    doc = doc.replace("\n  ", " ")  # a list item's lines, joined
    for name, body in re.findall(r"An? \*\*([a-z ]+)\*\* is (.*?)\.(?: |$)", doc, re.M):
        keys = set(re.findall(r"`(\w+)`", _without_parentheses(body)))
        if body.startswith("an entry"):
            keys |= shapes["entry"]
        shapes[name] = keys
    return shapes


def _keys(cell: str, shapes: dict[str, set[str]]) -> set[str]:
    text = _without_parentheses(cell)
    keys = set(re.findall(r"`(\w+)`", text))
    prose = re.sub(r"`\w+`", "", text)
    for name, named in shapes.items():
        plural = re.sub(r"y$", "ie", name) + "s"
        if re.search(rf"\b({name}|{plural})\b", prose):
            keys |= named
    return keys


def documented() -> dict[str, tuple[str, set[str], set[str]]]:
    """Per command: its shape, the keys it always prints, and those it may print too."""
    doc = DOC.read_text()
    shapes = _named_shapes(doc)
    rows: dict[str, tuple[str, set[str], set[str]]] = {}
    for command, shape, cell in re.findall(
        r"^\| `vault ([^`]+)` \| ([^|]+) \| (.+) \|$", doc, re.M
    ):
        command = re.sub(r" -o FILE$", "", command)
        always, _, sometimes = cell.partition("; ")
        rows[command] = (shape.strip(), _keys(always, shapes), _keys(sometimes, shapes))
    return rows


def test_every_command_that_reports_takes_json_and_is_documented() -> None:
    listed = set(commands(build_parser())) - {""}
    reporting = listed - SERVERS
    assert {c for c in reporting if not takes_json(c)} == set()
    rows = documented()
    assert set(rows) == reporting
    for command, (shape, always, _) in rows.items():
        assert shape.split(";")[0] in ("object", "list", "lines"), command
        assert always, f"{command}: no keys documented"


def check(command: str, printed: Any) -> None:
    shape, always, sometimes = documented()[command]
    if shape.startswith("list") or shape == "lines":
        assert isinstance(printed, list) and printed, (command, printed)
        objects = printed
    else:
        assert isinstance(printed, dict), (command, printed)
        objects = [printed]
    for value in objects:
        assert always <= set(value) <= always | sometimes, (command, sorted(value))


@pytest.fixture
def server(start_vault: Any) -> VaultServer:
    return start_vault()  # type: ignore[no-any-return]


def test_what_each_command_prints_has_the_documented_keys(
    server: VaultServer, tmp_path: Path
) -> None:
    def run(*args: str) -> Any:
        return server.run(*args, "--json").ok().json()

    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"weights of a small model\n")
    put = run("put", str(blob))
    check("put", put)
    digest = put["sha256"]
    check("get", run("get", digest, "-o", str(tmp_path / "copy.bin")))
    check("pin", run("pin", "image", digest))
    check("stat", run("stat", digest))
    missing = server.run("find-missing", "sha256:" + "0" * 64, "--json")
    assert missing.returncode == 66
    check("find-missing", missing.json())
    check("lookup", run("lookup", digest))
    logged = server.run("log", "--json").ok().stdout
    check("log", [json.loads(line) for line in logged.splitlines()])
    check("checkpoint", run("checkpoint"))
    assert set(run("checkpoint", "--key")) == {"verifier_key"}
    check("proof inclusion", run("proof", "inclusion", "0"))
    check("proof consistency", run("proof", "consistency", "1", "1"))

    folder = tmp_path / "data"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "a.csv").write_text("x\n1\n")
    added = run("dataset", "add", "mnist", str(folder), "--tag", "v1")
    check("dataset add", added)
    (folder / "train" / "b.csv").write_text("x\n2\n")
    changed = run("dataset", "add", "mnist", str(folder), "--tag", "v2")
    check("dataset ls", run("dataset", "ls"))
    check("dataset show", run("dataset", "show", "mnist@v1"))
    check("dataset checkout", run("dataset", "checkout", "mnist@v1", str(tmp_path / "out")))
    check("dataset diff", run("dataset", "diff", added["digest"], changed["digest"]))
    check("admit", run("admit", "--image", digest, "--dataset", added["digest"], "--seed", "1"))

    check("verify", run("verify"))
    check("verify", run("verify", "--blobs"))
    host = {"PINVAULT_DATA_DIR": str(server.data_dir)}
    check("tier status", server.run("tier", "status", "--json", env=host).ok().json())
    check("scrub", server.run("scrub", "--json", env=host).ok().json())
    keys = tmp_path / "keys"
    check("keys init", run("keys", "init", str(keys)))
    issued = run(
        "keys", "issue", str(keys), "--name", "ada", "--team", "vision", "--role", "reader"
    )
    check("keys issue", issued)
