"""docs/compatibility.md stays true: its request table names the code's own list of
parameters served without drafts and only tests that exist (every request case of
the matrix among them); its architecture table is the architecture matrix's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_architecture_matrix import STATUSES

from vllm_lookahead.worker.request_support import UNDRAFTED_PARAMETERS

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def table(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table under ``## heading``."""
    text = (ROOT / "docs" / "compatibility.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def defined_tests(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def matrix_cases() -> set[str]:
    tree = ast.parse((TESTS / "test_request_matrix.py").read_text())
    cases = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "CASES")
    return {key.value for key in cases.keys}


def named_tests(cell: str) -> list[tuple[str, str, str | None]]:
    """(file, function, parameter) of every ``file.py::test_name[param]`` in a cell."""
    return re.findall(r"`(test_\w+\.py)::(test_\w+)(?:\[(\w+)\])?`", cell)


def test_the_request_table_names_the_code_and_existing_tests():
    rows = table("Requests")
    undrafted = {re.sub(r"`", "", feature) for feature, status, *_ in rows
                 if status == "exact, without drafts"}
    assert undrafted == set(UNDRAFTED_PARAMETERS)
    named = [test for row in rows for test in named_tests(row[3])]
    assert len(named) > 30
    for file, function, parameter in named:
        assert function in defined_tests(TESTS / file), f"{file}::{function}"
        if parameter:
            assert parameter in matrix_cases(), f"{function}[{parameter}]"
    assert matrix_cases() <= {parameter for _, _, parameter in named}
    every_matrix_test = defined_tests(TESTS / "test_request_matrix.py")
    assert every_matrix_test <= {function for _, function, _ in named}


def test_the_architecture_table_is_the_matrixs():
    rows = {row[0].strip("`"): (row[1], row[2]) for row in table("Architectures")}
    assert rows == {name: (family.status, family.on_0_26)
                    for name, family in STATUSES.items()}
