"""The README's Python examples run as written, in order, in one namespace."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[2] / "README.md"


# Documentation code blocks are the slow tier's, with the guides' (tests/docs/test_docs.py).
@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 3
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
