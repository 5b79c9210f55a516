"""One folder per benchmark run: ``benchmarks/results/<date>-<name>/``.

Every writer (run, tree_cost, mtad, load_test, replay) makes its folder here: the date,
a name that says what was measured (by default ``<machine>-<model>-<what>``), ``-2``,
``-3``, ... only if that folder exists, and ``command.txt`` with the exact command.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that runs ``python -m module`` with ``argv`` (default: this process's)."""
    return shlex.join([sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)])


def make_run_folder(parent: Path, name: str, command: str) -> Path:
    """Create ``parent/<today>-<name>[-N]/`` holding ``command.txt``; returns the folder."""
    parent.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{name}"
    folder, index = parent / stem, 1
    while True:
        try:
            folder.mkdir()
            break
        except FileExistsError:
            index += 1
            folder = parent / f"{stem}-{index}"
    (folder / "command.txt").write_text(command + "\n")
    return folder


def add_arguments(parser: argparse.ArgumentParser, default_name: str | None) -> None:
    """``--output-dir`` (the results folder, parent of the run folders) and ``--name``."""
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR,
                        help="parent of the run's folder")
    parser.add_argument("--name", type=_folder_name,
                        help="the run folder's name after the date, e.g. "
                             "cpu-2c-smollm2-135m-latency-trees; if not given: "
                             + (default_name or "nothing is written"))


def _folder_name(text: str) -> str:
    if not text or "/" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a folder name, not a path: {text!r}")
    return text
