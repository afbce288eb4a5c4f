"""The command's subcommands, each one's arguments added only when it is the one run: `vault
--help` and a scheduler's `vault stat` build (and import) nothing for the other commands; and
the options every command takes, before its name or after it (`vault mirror add --config F`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

# Adds a subcommand's arguments (and its own subcommands) to its parser.
Build = Callable[[argparse.ArgumentParser], None]


def add_global_options(parser: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """The options of the `vault` command itself. After a command's name they are accepted too,
    unshown in its help and set only when given (so that one given before the name holds),
    except where the command has an option of the same spelling (`vault run --config`)."""
    options: list[tuple[tuple[str, ...], dict[str, Any]]] = [
        (("--config",), {"help": "TOML config file (default: $PINVAULT_CONFIG)"}),
        (
            ("--server",),
            {"help": "vault server address (default: client.server, 127.0.0.1:7411)"},
        ),
        (("--data-dir",), {"help": "data folder for `serve` (default: ~/.local/share/pinvault)"}),
        (("-v", "--verbose"), {"action": "store_true", "help": "log more"}),
    ]
    for flags, kwargs in options:
        if after_command:
            if any(flag in parser._option_string_actions for flag in flags):
                continue
            kwargs = {**kwargs, "help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
        parser.add_argument(*flags, **kwargs)


def _accept_global_options(parser: argparse.ArgumentParser) -> None:
    """Add the global options to `parser` and to every subcommand under it."""
    add_global_options(parser, after_command=True)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _accept_global_options(child)


class LazyCommands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subparsers whose arguments are added when argparse hands the command line to one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, Build] = {}

    def defer(self, name: str, build: Build) -> None:
        self._pending[name] = build

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        # argparse hands over the command's name and the words after it.
        if isinstance(values, list) and values:
            build = self._pending.pop(values[0], None)
            if build is not None:
                build(self._name_parser_map[values[0]])
                _accept_global_options(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


def lazy(parser: argparse.ArgumentParser) -> None:
    """Make the subparsers `parser` adds next `LazyCommands`."""
    parser.register("action", "parsers", LazyCommands)


def add_command(sub: Any, name: str, build: Build, **kwargs: Any) -> argparse.ArgumentParser:
    """Add the subcommand `name` (its `help`, `description`, … in `kwargs`) to `sub`, and its
    arguments with `build`: now, or when it is run if `sub` is `LazyCommands`."""
    parser: argparse.ArgumentParser = sub.add_parser(name, **kwargs)
    if isinstance(sub, LazyCommands):
        sub.defer(name, build)
    else:
        build(parser)
        _accept_global_options(parser)
    return parser
