"""pinvault installed as a user installs it: `uv tool install` of this checkout into a tool
folder of the test's own, so that its `vault` is the only one on the PATH a test gives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.services.vault_server import REPO_ROOT


def uv_command() -> list[str]:
    """uv as scripts/test installed it: on PATH, or as a module of this Python."""
    found = shutil.which("uv")
    return [found] if found else [sys.executable, "-m", "uv"]


def install_vault(folder: Path) -> Path:
    """Install this checkout with `uv tool install` under `folder`; the folder of its
    executables (which holds `vault`)."""
    tools, executables = folder / "tools", folder / "bin"
    done = subprocess.run(
        [*uv_command(), "tool", "install", "--force", "--python", sys.executable, str(REPO_ROOT)],
        env={
            **{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
            "UV_TOOL_DIR": str(tools),
            "UV_TOOL_BIN_DIR": str(executables),
        },
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (executables / "vault").is_file(), done.stderr
    return executables
