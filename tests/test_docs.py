"""The Markdown a reader follows: every relative link resolves (a number in a README
cannot lose the run folder it came from), the README stays a user's page, and its
results are the table and figure ``benchmarks.headline_figure`` draws from the runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from benchmarks import headline_figure

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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
    lines = README.read_text().splitlines()
    assert len(lines) <= 150
    first_screen = "\n".join(lines[:60])
    for needed in ("pip install", "vllm serve", "LLM("):
        assert needed in first_screen, needed
    text = "\n".join(lines)
    # the two set-up commands, the figure's command, and how to turn the plugin off
    for needed in ("bash scripts/demo.sh", "bash scripts/test.sh",
                   "python -m benchmarks.headline_figure", "VLLM_PLUGINS="):
        assert needed in text, needed


def results_section(text: str) -> str:
    return text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]


def unlinked_numbers(section: str) -> list[str]:
    """Lines of a results section that state a speedup ("1.45x") without a link to a run
    folder or to the full results."""
    return [line for line in section.splitlines() if re.search(r"\d\.\d+x", line)
            and "benchmarks/results/" not in line and "docs/results.md" not in line]


def test_the_readmes_results_are_the_runs_figure_and_table():
    section = results_section(README.read_text())
    assert "](benchmarks/headline.png)" in section
    assert "\n".join(headline_figure.table_lines()) in section
    assert unlinked_numbers(section) == []


def test_a_speedup_without_its_run_is_caught():
    assert unlinked_numbers("| a | 1.45x | [(fn)](benchmarks/results/x/README.md) |\n"
                            "lookahead made 1.99x there\n") == ["lookahead made 1.99x there"]


def test_the_headline_table_reads_the_runs():
    """Every cell the figure draws names a run of the index and finds its method there."""
    cells = [cell for row in headline_figure.ROWS for cell in row.cells]
    assert {run for cell in cells for run in cell.runs} <= set(headline_figure.folders())
    for cell in cells:
        assert headline_figure.speedup(cell, "lookahead"), cell
