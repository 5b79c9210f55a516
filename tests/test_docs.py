"""The Markdown a reader follows: every relative link resolves (a number in a README
cannot lose the run folder it came from), and the README stays a user's page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``[text](target)``, the target without a title; images included
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text(errors="replace")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a web address or an anchor on the same page
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    return broken


def test_every_relative_link_in_the_markdown_resolves():
    files = markdown_files()
    links = sum(len(LINK.findall(f.read_text(errors="replace"))) for f in files)
    assert links > 400 and any("benchmarks/results" in str(f) for f in files)  # not vacuous
    broken = {str(f.relative_to(ROOT)): links for f in files if (links := broken_links(f))}
    assert broken == {}


def test_a_link_to_a_missing_run_folder_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[run (zz)](benchmarks/results/2099-01-01-none/README.md), "
                    "[web](https://example.com), [here](#results)\n")
    assert broken_links(page) == ["benchmarks/results/2099-01-01-none/README.md"]


def test_the_readme_is_a_users_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250
    first_screen = "\n".join(lines[:60])
    for needed in ("pip install", "vllm serve", "LLM("):
        assert needed in first_screen, needed
