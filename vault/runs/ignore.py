"""Which files of a folder a dataset leaves out: `--exclude` patterns and the folder's own
`.vaultignore`, a pattern a line, in the plain subset of gitignore everyone reads the same way.

- `*.tmp`, `cache`: a pattern without `/` matches a file or folder of that name at any depth;
- `raw/2024-*.csv`: a pattern with `/` matches the path from the folder's top (a leading `/`
  only anchors it there too);
- `logs/`: a trailing `/` matches folders only;
- `*`, `?`, `[abc]` as in the shell (fnmatch), never across a `/`; blank lines and lines
  starting with `#` are skipped. Negation (`!`) and `**` are refused rather than guessed at."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from vault.errors import InvalidArgument

IGNORE_FILE: Final = ".vaultignore"
# More would be a file someone did not mean as ignore rules.
MAX_IGNORE_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class _Rule:
    pattern: str
    anchored: bool
    folders_only: bool
    matcher: re.Pattern[str]


def _rule(pattern: str, where: str) -> _Rule:
    text = pattern.strip()
    if text.startswith("!"):
        raise InvalidArgument(f"{where}: {pattern!r}: negation (!) is not supported")
    if "**" in text:
        raise InvalidArgument(f"{where}: {pattern!r}: '**' is not supported")
    folders_only = text.endswith("/")
    body = text.rstrip("/")
    anchored = "/" in body
    body = body.lstrip("/")
    if not body:
        raise InvalidArgument(f"{where}: {pattern!r} matches nothing")
    return _Rule(text, anchored, folders_only, re.compile(_translate(body, pattern, where)))


def _translate(body: str, pattern: str, where: str) -> str:
    """The shell pattern as a regular expression whose `*`, `?` and `[…]` never match `/`."""
    out = []
    at = 0
    while at < len(body):
        char = body[at]
        at += 1
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = body.find("]", at + 1 if body[at : at + 1] in ("!", "]") else at)
            if end < 0:
                raise InvalidArgument(f"{where}: {pattern!r}: '[' without its ']'")
            inside = body[at:end]
            negate = inside.startswith("!")
            inside = inside[1:] if negate else inside
            members = re.escape(inside).replace("\\-", "-")
            out.append(f"(?![/])[{'^' if negate else ''}{members}]")
            at = end + 1
        else:
            out.append(re.escape(char))
    return "".join(out)


class IgnoreRules:
    """Patterns that leave files and folders out of a dataset (see the module's text)."""

    def __init__(self, rules: Iterable[_Rule] = ()) -> None:
        self._rules = tuple(rules)

    @classmethod
    def load(cls, root: Path, exclude: Iterable[str] = ()) -> IgnoreRules:
        """`exclude` plus the rules of `root/.vaultignore`, if there is one."""
        rules = [_rule(p, "--exclude") for p in exclude]
        path = root / IGNORE_FILE
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()[: MAX_IGNORE_BYTES + 1]
            if len(data) > MAX_IGNORE_BYTES:
                raise InvalidArgument(f"{path}: more than {MAX_IGNORE_BYTES} bytes")
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgument(f"{path}: not UTF-8 text") from None
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip() and not line.lstrip().startswith("#"):
                    rules.append(_rule(line, f"{path} line {number}"))
        return cls(rules)

    def __bool__(self) -> bool:
        return bool(self._rules)

    def ignores(self, path: str, *, folder: bool) -> bool:
        """Whether the file or folder at `path` (relative, POSIX) is left out."""
        name = path.rsplit("/", 1)[-1]
        for rule in self._rules:
            if rule.folders_only and not folder:
                continue
            if rule.matcher.fullmatch(path if rule.anchored else name):
                return True
        return False
