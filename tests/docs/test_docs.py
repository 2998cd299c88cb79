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


def test_the_index_tree_names_every_module_of_the_two_layers_and_no_other():
    text = (DOCS / "index.md").read_text()
    tree = next(b for b in re.findall(r"```text\n(.*?)```", text, re.S) if "  heads/" in b)
    listed, folder = set(), None
    for line in tree.splitlines():
        if m := re.match(r"^  (\w+)/", line):
            folder = m[1]
        elif m := re.match(r"^    (\w+\.py)\s", line):
            listed.add(f"{folder}/{m[1]}")
    package = DOCS.parent / "samplers"
    modules = {
        f"{layer}/{p.name}"
        for layer in ("distributions", "heads")
        for p in (package / layer).glob("*.py")
        if not p.name.startswith("_")
    }
    assert listed == modules, (
        f"docs/index.md's module tree lacks {sorted(modules - listed)} and names "
        f"{sorted(listed - modules)}, which do not exist; update the tree."
    )
