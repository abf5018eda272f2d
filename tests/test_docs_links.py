"""Every relative link in the README, docs/*.md and benchmarks/**/*.md points to a tracked file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return set(out.splitlines())


def _markdown_files(tracked: set[str]) -> list[str]:
    return sorted(
        f for f in tracked
        if f == "README.md" or (f.startswith("docs/") and f.endswith(".md"))
        or (f.startswith("benchmarks/") and f.endswith(".md"))
    )


def broken_links() -> list[str]:
    tracked = _tracked()
    folders = {str(Path(f).parent) for f in tracked}
    folders |= {str(p) for f in tracked for p in Path(f).parents}
    broken = []
    for md in _markdown_files(tracked):
        text = (ROOT / md).read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, mailto: or an anchor in the same page
            path = unquote(target.split("#", 1)[0])
            resolved = (ROOT / md).parent.joinpath(path).resolve()
            try:
                rel = resolved.relative_to(ROOT).as_posix()
            except ValueError:
                broken.append(f"{md}: {target} (outside the repository)")
                continue
            if rel not in tracked and rel.rstrip("/") not in folders:
                broken.append(f"{md}: {target}")
    return broken


def test_relative_links_point_to_tracked_files() -> None:
    assert broken_links() == []
