"""The README: its Python examples run as written, and it stays a two-minute read.

The examples run in order, in one namespace, in the slow tier (the README says
``python -m pytest -m slow`` runs them), with the guides' examples
(tests/docs/test_docs.py). Results tables live in the guides.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[2]
README = ROOT / "README.md"
MAX_LINES = 150


@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 3
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_is_at_most_150_lines_and_holds_no_table():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_LINES}; move the details to a guide "
        f"under docs/guides/ and link it."
    )
    tables = [i + 1 for i, line in enumerate(lines) if line.lstrip().startswith("|")]
    assert not tables, f"README.md has table rows on lines {tables}; tables belong in the guides."


def test_readme_gives_the_test_commands_that_ci_runs():
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python -m pytest")
    ]
    assert commands == [
        "python -m pytest",
        "python -m pytest -m slow",
        "python -m pytest -m accelerator -n 0",
    ]
    text = README.read_text()
    for command in commands:
        assert re.search(rf"{re.escape(command)}(?![\w -])", text), command
