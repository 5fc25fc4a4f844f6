"""The README's quick start is a promise: CI must run exactly those commands, so they cannot drift apart."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    """The command lines of the first fenced block under the README's "## Quick start" heading."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert section, "README.md has no '## Quick start' section"
    block = re.search(r"^```(?:bash|sh)?\n(.*?)^```", section.group(1), flags=re.M | re.S)
    assert block, "the Quick start section has no fenced code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_has_exactly_two_commands() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0] == "pip install -e . && python -m ibpcache"
    assert "python -m pytest" in commands[1]


def test_ci_runs_the_readme_commands_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    ci_lines = [line.strip() for line in ci.splitlines()]
    for command in _quick_start_commands():
        assert any(line.startswith(command) for line in ci_lines), f".ci/run does not run {command!r}"


def test_ci_script_is_strict_and_executable() -> None:
    path = ROOT / ".ci" / "run"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(path, os.X_OK), ".ci/run must be executable"
    assert "python3 -m pip install torch==2.13.0" in text
    assert "bash scripts/check_kernels.sh" in text
