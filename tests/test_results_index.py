"""docs/results/README.md is the index of every measurement: each file under docs/results is listed in its folder's
section, every folder has notes, and each benchmark JSON's row carries the commit and device the JSON itself records,
so a number can always be traced to the code and machine that produced it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
INDEX = RESULTS / "README.md"


def _folders() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def _sections() -> dict[str, str]:
    """Folder name -> the index text of its '### `folder/`' section."""
    parts = re.split(r"^### `([^`]+)/`\n", INDEX.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _row(section: str, rel: str) -> str:
    """The table row whose file column names ``rel``."""
    rows = [line for line in section.splitlines() if line.startswith("| ") and f"`{rel}`" in line.split(" | ")[0]]
    assert len(rows) == 1, f"{rel}: expected one index row, found {len(rows)}"
    return rows[0]


def _recorded(path: Path) -> tuple[str | None, str | None]:
    """(commit, device) as the JSON records them; (None, None) for files that record neither."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return None, None
    env = data.get("env")
    if isinstance(env, dict):
        return env.get("git_commit"), env.get("device") or ("CPU" if env.get("cuda_available") is False else None)
    return None, data.get("device")


def test_every_folder_has_notes_and_a_section() -> None:
    sections = _sections()
    folders = [f.name for f in _folders()]
    assert folders, "docs/results holds no folders"
    assert sorted(sections) == folders, "the index sections differ from the folders under docs/results"
    folder_table = INDEX.read_text().split("## Files", 1)[0]
    for name in folders:
        assert (RESULTS / name / "README.md").is_file(), f"{name}/ has no README.md (its dated notes)"
        assert f"[`{name}/`]({name}/README.md)" in folder_table, f"{name}/ is missing from the folder table"


@pytest.mark.parametrize("folder", [f.name for f in _folders()])
def test_every_file_is_listed_in_its_folder_section(folder: str) -> None:
    section = _sections()[folder]
    files = sorted(p.relative_to(RESULTS / folder).as_posix() for p in (RESULTS / folder).rglob("*") if p.is_file())
    missing = [rel for rel in files if f"`{rel}`" not in section]
    assert not missing, f"{folder}/: files not in the index: {missing}"
    file_cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    listed = [rel for cell in file_cells for rel in re.findall(r"`([^`]+)`", cell)]
    assert listed, f"{folder}/: its section has no file rows"
    stale = [rel for rel in listed if not (RESULTS / folder / rel).is_file()]
    assert not stale, f"{folder}/: the index names files that do not exist: {stale}"


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_json_rows_carry_the_recorded_commit_and_device(path: Path) -> None:
    folder = path.relative_to(RESULTS).parts[0]
    row = _row(_sections()[folder], path.relative_to(RESULTS / folder).as_posix())
    commit, device = _recorded(path)
    cells = row.split(" | ")
    if commit is not None:
        assert f"`{commit}`" in cells[3], f"{path.name}: the code column lacks the recorded HEAD {commit}"
    if device is not None:
        assert device in cells[2], f"{path.name}: the device column lacks the recorded device {device!r}"
    assert re.search(r"\b2\d{3}-\d{2}-\d{2}", row) or "not recorded" in cells[1], f"{path.name}: no date"


def test_recorded_metadata_is_read() -> None:
    """The check above must see what benchmark JSONs record (one known file), or it would pass vacuously."""
    commit, device = _recorded(RESULTS / "2026-11-25-h100-s21" / "bench_llm_qwen7b_final_w2.json")
    assert commit == "ca548f8" and device == "NVIDIA H100 80GB HBM3"
