"""Text a writer puts in an entry cannot pass for other output: metadata with control
characters, line or paragraph separators or bidirectional controls is refused by the real
server (and nothing is appended), through the client and through the command; and such text
stored by an earlier release is shown escaped."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer
from vault.errors import InvalidArgument, NotFound
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import open_database
from vault.ledger.entry import UNSAFE_TEXT
from vault.ledger.log import Ledger, PinSpec

ORIGIN = "text.test/ledger"
ENV = {"PINVAULT_LEDGER_ORIGIN": ORIGIN}

# A newline that would print a forged entry line under the real one in `vault log`, and the
# other characters that rewrite what a terminal or a page shows.
HOSTILE_VALUES = {
    "newline": "ok\n     7  2026-01-01T00:00:00.000000Z  image  sha256:forged  by admin",
    "carriage return": "ok\rforged",
    "tab": "a\tb",
    "escape sequence": "\x1b[2J\x1b[Hcleared",
    "DEL": "a\x7fb",
    "C1 control": "a\x85b",
    "line separator": "a\u2028b",
    "paragraph separator": "a\u2029b",
    "right-to-left override": "exe.\u202etxt",
    "isolate": "a\u2066b\u2069",
    "left-to-right mark": "a\u200eb",
}


def _subject(label: str) -> str:
    return "sha256:" + hashlib.sha256(label.encode()).hexdigest()


@pytest.mark.parametrize("label", sorted(HOSTILE_VALUES))
def test_the_server_refuses_metadata_that_could_forge_output(
    vault_server: VaultServer, label: str
) -> None:
    value = HOSTILE_VALUES[label]
    with vault_server.client() as client:
        before = client.checkpoint().size
        with pytest.raises(InvalidArgument, match=r"metadata value for 'note' has U\+[0-9A-F]{4}"):
            client.pin("config", _subject(label), meta={"note": value}, external=True)
        assert client.checkpoint().size == before, "nothing was appended"
        with pytest.raises(NotFound):
            client.lookup(_subject(label))


def test_the_command_names_the_character_it_refused(vault_server: VaultServer) -> None:
    run = vault_server.run(
        "pin",
        "config",
        _subject("command"),
        "--external",
        "--meta",
        "note=" + HOSTILE_VALUES["newline"],
    )
    line = run.error_line()
    assert "metadata value for 'note' has U+000A at character 2" in line
    assert vault_server.run("lookup", _subject("command")).returncode != 0


def test_plain_text_in_any_script_is_kept(vault_server: VaultServer) -> None:
    value = "ResNet-50 на ImageNet, 学習率 0.1, שלום, emoji 🧪 and a zero-width joiner a\u200db"
    with vault_server.client() as client:
        entry = client.pin("config", _subject("plain"), meta={"note": value}, external=True)
        assert entry.entry.meta["note"] == value


def test_text_an_earlier_release_stored_is_shown_escaped(start_vault: StartVault) -> None:
    """An entry appended before values were checked (as pinvault 0.1 did, or as a hostile
    server sends) still verifies, and `vault log` and `vault lookup` show its odd characters
    escaped, one entry a line, never as a forged line or a terminal control."""
    server = start_vault(env=ENV)
    with server.client() as client:
        client.pin("config", _subject("before"), external=True)
    assert server.stop() == 0
    db = open_database(f"sqlite:///{server.db_path}")
    ledger = Ledger(db, SigningKey.load(server.data_dir / "checkpoint.key"), origin=ORIGIN)
    unchecked = PinSpec(
        kind="config",
        subjects=(_subject("old"),),
        author="old-release",
        meta={"note": HOSTILE_VALUES["newline"] + HOSTILE_VALUES["escape sequence"]},
        external=True,
    )
    ledger.append([unchecked])
    ledger.close()
    db.dispose()
    server.restart()

    log = server.run("log").ok()
    lines = log.stdout.splitlines()
    assert len([line for line in lines if line.strip()]) == 2, log.describe()
    assert "\x1b" not in log.stdout and "sha256:forged" in lines[1]
    assert "ok\\u{000a}     7  2026-01-01" in lines[1] and "\\u{001b}[2J" in lines[1]
    found = server.run("lookup", _subject("old")).ok()
    assert "\n     7  2026" not in found.stdout and "\\u{000a}" in found.stdout
    assert "ledger OK" in server.run("verify").ok().stdout


# File names a writer chose: a title change, a screen clear, a right-to-left override, and a
# newline followed by a forged line of `vault dataset diff`.
HOSTILE_FILE_NAMES = (
    "title\x1b]0;pwned\x07.txt",
    "clear\x1b[2J\x1b[H.txt",
    "report.\u202etxt.exe",
    "x\n+ weights/official-checkpoint.bin",
)


def test_dataset_commands_show_hostile_file_names_escaped(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "plain.txt").write_bytes(b"plain")
    for n, name in enumerate(HOSTILE_FILE_NAMES):
        (new / name).parent.mkdir(exist_ok=True)
        (new / name).write_bytes(b"file %d" % n)
    vault_server.run("dataset", "add", "before", str(old)).ok()
    vault_server.run("dataset", "add", "after", str(new)).ok()

    diff = vault_server.run("dataset", "diff", "before", "after").ok()
    escaped = {
        "title\\u{001b}]0;pwned\\u{0007}.txt",
        "clear\\u{001b}[2J\\u{001b}[H.txt",
        "report.\\u{202e}txt.exe",
        "x\\u{000a}+ weights/official-checkpoint.bin",
    }
    assert sorted(diff.stdout.splitlines()) == sorted(
        [*(f"+ {name}" for name in escaped), "- plain.txt"]
    )
    # The machine's output keeps every name exactly, as JSON escapes.
    as_json = vault_server.run("dataset", "diff", "before", "after", "--json").ok()
    assert not re.search(f"[{UNSAFE_TEXT}]", as_json.stdout.rstrip("\n"))
    assert sorted(as_json.json()["added"]) == sorted(HOSTILE_FILE_NAMES)
    for args in (("show", "after"), ("ls",), ("checkout", "after", str(tmp_path / "out"))):
        shown = vault_server.run("dataset", *args).ok()
        assert not any(re.search(f"[{UNSAFE_TEXT}]", line) for line in shown.stdout.splitlines())
    out = tmp_path / "out"
    checked_out = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    assert sorted(checked_out) == sorted(HOSTILE_FILE_NAMES)
