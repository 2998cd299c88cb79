"""The documentation's Python examples run as written, and its API reference is complete."""

import pathlib
import re

import pytest

import samplers

DOCS = pathlib.Path(__file__).parents[2] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def _python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in PAGES if _python_blocks(p)], ids=lambda p: str(p.relative_to(DOCS))
)
def test_page_python_blocks_run_in_order(page):
    namespace = {}
    for block in _python_blocks(page):
        exec(compile(block, str(page), "exec"), namespace)


def test_the_api_reference_documents_every_public_name():
    text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"^\.\. auto(?:class|function):: samplers\.(\w+)$", text, re.M))
    assert documented == set(samplers.__all__)
