"""The README's quick start is a promise: CI must run exactly those commands, in the same order, each in a fresh
virtual environment (so a missing install step fails CI), so they cannot drift apart."""

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


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_quick_start_has_exactly_two_commands() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0] == "pip install -e . && python -m ibpcache"
    assert "python -m pytest" in commands[1]


def test_ci_runs_the_readme_commands_verbatim_in_readme_order() -> None:
    lines = _ci_lines()
    positions = []
    for command in _quick_start_commands():
        hits = [i for i, line in enumerate(lines) if line.startswith(command)]
        assert len(hits) == 1, f".ci/run must run {command!r} exactly once, found {len(hits)}"
        assert lines[hits[0]] == f"{command} || exit $?", f"{lines[hits[0]]!r}: the list must end in '|| exit $?'"
        positions.append(hits[0])
    assert positions == sorted(positions), ".ci/run runs the README commands in another order than the README"


def test_each_readme_command_runs_in_its_own_fresh_venv() -> None:
    """Between two README commands (and before the first) .ci/run creates and activates a new venv."""
    lines = _ci_lines()
    text = "\n".join(lines)
    body = re.search(r"^fresh_venv\(\) \{\n(.*?)^\}", text, flags=re.M | re.S)
    assert body, ".ci/run has no fresh_venv() function"
    assert re.search(r"python3 -m venv \"\$dir\"", body.group(1)) and 'mktemp -d "/tmp/' in body.group(1)
    assert '. "$dir/bin/activate"' in body.group(1)
    assert "python3 -m pip install torch==2.13.0" in body.group(1)
    starts = [i for i, line in enumerate(lines) if any(line.startswith(c) for c in _quick_start_commands())]
    calls = [i for i, line in enumerate(lines) if re.fullmatch(r"fresh_venv \w+", line)]
    assert len(calls) == len(starts) == 2
    bounds = [-1, *starts]
    for k, start in enumerate(starts):
        assert any(bounds[k] < c < start for c in calls), f"README command {k + 1} does not get a fresh venv"
        names = [lines[c].split()[1] for c in calls]
    assert len(set(names)) == len(names), "each venv needs its own name"


def test_ci_script_is_strict_and_executable() -> None:
    path = ROOT / ".ci" / "run"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(path, os.X_OK), ".ci/run must be executable"
    assert "python3 -m pip install torch==2.13.0" in text
    assert "bash scripts/check_kernels.sh" in text
