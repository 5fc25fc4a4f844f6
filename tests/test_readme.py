"""The README is a promise. Its quick start: CI must run exactly those commands, in the same order, each in a fresh
virtual environment (so a missing install step fails CI). Its examples: every ```python block is marked
``<!-- test: cpu|gpu [needs=a,b] -->``, defines every name it uses, and a ``cpu`` block runs as written here (and
again, marked ``gpu``, on a machine with a GPU, where the same code picks CUDA). Its results: every row links the JSON
it came from and names its device and date."""

from __future__ import annotations

import builtins
import importlib.util
import os
import re
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_MARKER = re.compile(r"<!-- test: (cpu|gpu)(?: needs=([\w,-]+))? -->")
_SNIPPET_TIMEOUT_S = 600


def _quick_start_commands() -> list[str]:
    """The command lines of the first fenced block under the README's "## Quick start" heading."""
    text = README.read_text()
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


# --------------------------------------------------------------------------------------------------------------
# The examples


@dataclass(frozen=True)
class Snippet:
    """One ```python block of the README and the marker line right above it (None when it has none)."""

    line: int
    kind: str | None
    needs: tuple[str, ...]
    code: str

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def _snippets() -> list[Snippet]:
    text = README.read_text()
    out = []
    for block in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        before = text[: block.start()]
        marker = _MARKER.fullmatch(before.rstrip("\n").rsplit("\n", 1)[-1])
        needs = tuple(n for n in (marker.group(2) or "").split(",") if n) if marker else ()
        out.append(Snippet(before.count("\n") + 1, marker.group(1) if marker else None, needs, block.group(1)))
    return out


def _undefined_names(code: str) -> set[str]:
    """Names the code reads but never binds (imports, assignments, loop and with targets, defs) and that are no
    builtins; names read inside functions, lambdas and comprehensions count when they are globals."""
    top = symtable.symtable(code, "<README>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    known = bound | set(dir(builtins))
    missing = {s.get_name() for s in top.get_symbols() if s.is_referenced() and s.get_name() not in known}
    stack = list(top.get_children())
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        missing |= {s.get_name() for s in table.get_symbols()
                    if s.is_referenced() and s.is_global() and s.get_name() not in known}
    return missing


def _missing_need(need: str) -> str | None:
    """Why the optional dependency ``need`` is unavailable here, or None: a module name, or ``shared-data``."""
    if need == "shared-data":
        from ibpcache.datasets import shared_data_dir

        try:
            shared_data_dir()
        except FileNotFoundError as exc:
            return str(exc)
        return None
    return None if importlib.util.find_spec(need) is not None else f"{need} is not installed"


def test_every_python_block_is_marked_and_the_markers_are_used() -> None:
    snippets = _snippets()
    assert len(snippets) >= 6, "the README should show one example per adapter"
    unmarked = [s.name for s in snippets if s.kind is None]
    assert not unmarked, f"python blocks without a '<!-- test: cpu|gpu [needs=...] -->' line above: {unmarked}"
    markers = _MARKER.findall(README.read_text())
    assert len(markers) == len(snippets), "a test marker that is not right above a python block"


def test_undefined_names_are_found() -> None:
    """The name check itself: it must see a name read before any binding, also inside comprehensions."""
    assert _undefined_names("import torch\nout = tbe(ids_BT)\n") == {"tbe", "ids_BT"}
    assert _undefined_names("x = [t[i] for i in range(3)]\n") == {"t"}
    assert _undefined_names("import os\nfor a in os.sep: print(a)\n") == set()


def test_missing_needs_are_named() -> None:
    """A block is skipped only for a dependency that is really absent, and the skip says which."""
    assert _missing_need("ibpcache") is None
    assert "not installed" in (_missing_need("ibpcache_no_such_module") or "")


@pytest.mark.parametrize("snippet", _snippets(), ids=lambda s: s.name)
def test_snippet_defines_every_name(snippet: Snippet) -> None:
    compile(snippet.code, snippet.name, "exec")
    assert not _undefined_names(snippet.code), f"{snippet.name} uses undefined names"


def _run(snippet: Snippet, *, hide_gpu: bool) -> None:
    for need in snippet.needs:
        reason = _missing_need(need)
        if reason is not None:
            pytest.skip(f"{snippet.name} needs {need}: {reason}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", snippet.code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=_SNIPPET_TIMEOUT_S, check=False)
    assert res.returncode == 0, f"{snippet.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


_CPU = [s for s in _snippets() if s.kind == "cpu"]


@pytest.mark.parametrize("snippet", _CPU, ids=lambda s: s.name)
def test_cpu_snippet_runs(snippet: Snippet) -> None:
    """As a reader on a machine without a GPU runs it (CUDA hidden even where one exists)."""
    _run(snippet, hide_gpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("snippet", [s for s in _snippets() if s.kind in ("cpu", "gpu")], ids=lambda s: s.name)
def test_snippet_runs_on_the_gpu(snippet: Snippet) -> None:
    """The same code on a GPU machine, where it picks CUDA (``gpu`` blocks run only here)."""
    _run(snippet, hide_gpu=False)


# --------------------------------------------------------------------------------------------------------------
# The results table


def _results_rows() -> list[str]:
    text = README.read_text()
    section = re.search(r"^## Results\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert section, "README.md has no '## Results' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    return rows[2:]  # after the header and its |---| line


def test_results_rows_link_their_json_and_name_device_and_date() -> None:
    rows = _results_rows()
    assert len(rows) >= 8, "one row per workload"
    for row in rows:
        links = re.findall(r"\]\((docs/results/[^)]+)\)", row)
        assert links, f"no link to docs/results in: {row[:80]}"
        for link in links:
            assert link.endswith(".json") and (ROOT / link).is_file(), f"{link}: not a results JSON"
        assert re.search(r"\b2\d{3}-\d{2}-\d{2}\b", row), f"no date in: {row[:80]}"
        assert re.search(r"\b(H100|H200|CPU)\b", row), f"no device in: {row[:80]}"
