"""README.md and docs/, kept true: the README's walk-through runs, command by command in one
shell, against a real `vault serve`, each command succeeding with the output the README shows;
the two commands are the ones CI and users run; every other `vault` command shown in the README
or docs/ is one the real command's parser takes; the configuration reference loads with the
real configuration reader; and every link between the README and docs/ reaches its file and
heading. (docs/python.md's examples run in tests/test_python_guide.py.)"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cli.main import UsageError, build_parser
from tests.services.vault_server import REPO_ROOT, VAULT_COMMAND, VaultServer, command_env
from vault import config
from vault.runs.dataset import add_dataset

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Where a `vault` command starts in a shell block: the line's start (after `$ `), after a
# variable set for it, or inside `$(…)`; through `uv run` or not.
COMMAND = re.compile(r"(?:^|[\s(])(?:uv run (?:--no-sync )?)?vault (.*)$")
# Separates one command's output from the next in the shell's standard output.
MARK = "@@readme-walkthrough@@"
# The README's size limit: what it is, the two commands and a walk-through; the rest in docs/.
MAX_README_BYTES = 15_000


def section(text: str, heading: str) -> str:
    """The text under a `## ` heading, up to the next heading of that level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def code_blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def walkthrough() -> list[tuple[str, list[str]]]:
    """Each `$ ` command of the walk-through's shell block, with the output lines under it."""
    (block, *_) = code_blocks(section(README.read_text(), "A walk-through"), "sh")
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"the walk-through's block starts with output: {line!r}"
            steps[-1][1].append(line)
    return steps


def shown(line: str) -> re.Pattern[str]:
    """What an output line the README shows must match: `…` stands for text it leaves out
    (a digest's tail, a time, an author); runs of spaces are alignment."""
    parts = [re.escape(" ".join(part.split())) for part in line.split("…")]
    return re.compile(".*?".join(parts))


def test_the_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.encode()) < MAX_README_BYTES, f"README.md is {len(text.encode())} bytes"
    serve, test = code_blocks(section(text, "Two commands"), "sh")
    assert serve == "pip install uv && uv run vault serve\n"
    assert test == "scripts/test\n"
    # CI runs exactly the README's test command.
    ci = [
        line
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [test.strip()]
    assert "](docs/cli.md)" in section(text, "Two commands")


def test_the_walkthrough_runs_as_the_readme_shows_it(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    steps = walkthrough()
    assert len(steps) >= 15, steps
    assert any(command.startswith("D=$(uv run vault dataset add ") for command, _ in steps)
    assert any(command.startswith("uv run vault admit ") for command, _ in steps)
    work = tmp_path / "work"
    work.mkdir()
    # One shell runs every command in order, as a reader would type them; `uv run vault` is the
    # checkout's own `vault` command.
    script = [
        "set -u",
        f'vault() {{ {shlex.join(VAULT_COMMAND)} "$@"; }}',
        "umask 022",
        'uv() { if [ "$1" = run ]; then shift; "$@"; else command uv "$@"; fi; }',
    ]
    for command, _ in steps:
        script += [command, f'printf "\\n{MARK} %s\\n" "$?"']
    env = command_env(
        state_home=tmp_path / "state",
        extra={"PINVAULT_CLIENT_SERVER": vault_server.address, "NO_COLOR": "1"},
    )
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outputs = result.stdout.split(f"\n{MARK} ")
    assert len(outputs) == len(steps) + 1, result.stdout + result.stderr
    # Chunk i holds the status of step i - 1, then what step i printed.
    printed_by_step: list[str] = []
    statuses: list[int] = []
    for index, chunk in enumerate(outputs):
        if index == 0:
            printed_by_step.append(chunk)
            continue
        status, _, rest = chunk.partition("\n")
        statuses.append(int(status))
        if index < len(outputs) - 1:
            printed_by_step.append(rest)
    for (command, expected), status, printed in zip(steps, statuses, printed_by_step, strict=True):
        context = f"$ {command}\n--- printed\n{printed}\n--- stderr\n{result.stderr[-3000:]}"
        assert status == 0, f"the walk-through's command failed ({status}): {context}"
        if not expected:
            continue
        lines = [line for line in printed.splitlines() if line.strip()]
        assert len(lines) == len(expected), f"expected {expected}: {context}"
        for want, got in zip(expected, lines, strict=True):
            assert shown(want).fullmatch(" ".join(got.split())), f"{want!r}: {context}"
    assert (work / "copy.txt").read_text() == "hello\n"
    assert (work / "copy" / "train" / "part-0.csv").read_text() == "label,pixels\n7,0 0 255\n"


def shown_commands() -> list[tuple[str, str]]:
    """Every `vault` command line in a shell block of the README and docs/, with its page."""
    found = []
    for page in PAGES:
        for language, body in FENCE.findall(page.read_text()):
            if language not in ("sh", "console", ""):
                continue
            lines = re.sub(r"\\\n\s*", "", body).splitlines()
            # In a block with prompts, the lines without one are output.
            prompted = any(line.startswith("$ ") for line in lines)
            for line in lines:
                if prompted and not line.startswith("$ "):
                    continue
                match = COMMAND.search(line.removeprefix("$ "))
                if match is not None:
                    command = match.group(1).split(")")[0]
                    found.append((str(page.relative_to(REPO_ROOT)), command))
    return found


def test_every_vault_command_the_readme_and_docs_show_is_one_the_command_takes() -> None:
    """Parsed by the real command's parser (which `vault` runs), not run: most need a lab's
    mirrors, cluster or credentials. What follows `--` goes to sbatch, as `vault run` does."""
    commands = shown_commands()
    assert len(commands) >= 30, commands
    refused = []
    for page, line in commands:
        # `"$@"` (a script passing on its arguments) passes on none here.
        words = [w for w in shlex.split(line.replace("…", "x"), comments=True) if w != "$@"]
        if "--" in words:
            words = words[: words.index("--")]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(words)
        except UsageError as error:
            refused.append(f"{page}: vault {line}: {error}")
        except SystemExit as exit_:
            if exit_.code:
                refused.append(f"{page}: vault {line}: exit {exit_.code}")
    assert refused == [], "\n".join(refused)


def test_the_guides_python_examples_run(
    vault_server: VaultServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/guide.md's ```python blocks run in order as one session, as docs/python.md's do,
    beside the dataset the README's walk-through makes."""
    found = code_blocks((DOCS / "guide.md").read_text(), "python")
    assert len(found) >= 2
    monkeypatch.setenv("PINVAULT_CLIENT_SERVER", vault_server.address)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "mnist-mini"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "part-0.csv").write_text("label,pixels\n7,0 0 255\n")
    with vault_server.client() as client:
        add_dataset(client, folder, tag="v1")
    session: dict[str, Any] = {"__name__": "__guide__"}
    for index, source in enumerate(found):
        exec(compile(source, f"docs/guide.md python block {index + 1}", "exec"), session)
    assert (tmp_path / "losses.csv").read_text() == "step,loss\n0,2.31\n"
    assert [proven.entry.kind for proven in session["proven"]] == ["artefact"]
    assert session["losses"]["loss"].tolist() == [2.31]
    assert session["parts"]["label"].tolist() == [7]


def test_the_configuration_reference_is_a_configuration_the_vault_loads(tmp_path: Path) -> None:
    """Every key the reference shows is one the vault knows, with a value it takes (an unknown
    or misspelt key is an error that names it)."""
    (example,) = code_blocks((DOCS / "configuration.md").read_text(), "toml")
    path = tmp_path / "vault.toml"
    path.write_text(example)
    loaded = config.load(str(path), environ={})
    assert loaded.mirrors.replicas == 3
    assert loaded.auth.mode == "credentials"
    assert loaded.policy.min_copies == 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_link_between_the_readme_and_docs_reaches_its_file_and_heading(page: Path) -> None:
    text = page.read_text()
    broken = []
    for target in LINK.findall(_outside_code(text)):
        if re.match(r"[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert broken == [], f"{page.relative_to(REPO_ROOT)}: {broken}"


def _outside_code(text: str) -> str:
    return FENCE.sub("", text)


def _anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer (GitHub's) gives the page's headings."""
    headings = re.findall(r"^#+ (.+)$", _outside_code(text), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
