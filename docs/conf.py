"""Sphinx configuration for the samplers documentation."""

import importlib.metadata
import inspect
import re

project = "samplers"
author = "The samplers authors"
copyright = "2026, The samplers authors"
release = importlib.metadata.version("samplers")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
python_use_unqualified_type_names = True

html_theme = "sphinx_book_theme"
html_title = "samplers"
html_theme_options = {"show_toc_level": 2}
html_static_path = ["_static"]
html_css_files = ["custom.css"]


def _readable(annotation: str) -> str:
    """jaxtyping's expansion of ``Float[ArrayLike, s]`` folded back, and short names."""
    annotation = re.sub(r"~?\b(?:[a-z_]\w*\.)+([A-Z]\w*)", r"\1", annotation)
    return re.sub(
        r"(\w+)\[Array, ('[^']*')\] \| \1\[ndarray, \2\](?: \| \w+)*",
        r"\1[ArrayLike, \2]",
        annotation,
    )


def _signature(app, what, name, obj, options, signature, return_annotation):
    if what == "class" and signature in ("(*args, **kwargs)", "(*args: Any, **kwargs: Any)"):
        # distrax's and flax's metaclasses hide the constructor's signature; read __init__'s.
        parameters = list(inspect.signature(obj.__init__).parameters.values())[1:]
        signature = str(inspect.Signature(parameters))
    if signature:
        signature = _readable(signature)
    if return_annotation:
        return_annotation = _readable(return_annotation)
    return signature, return_annotation


def _escape_types(app, what, name, obj, options, lines):
    """Napoleon's ``:type:`` lines, from jaxtyping annotations such as
    ``Float[ArrayLike, "*action"]``: the star would start an emphasis."""
    for i, line in enumerate(lines):
        if line.lstrip().startswith(":type:"):
            line = re.sub(r"~?\b(?:[a-z_]\w*\.)+(?=[A-Za-z_])", "", line)  # module paths
            lines[i] = re.sub(r"(?<!\\)\*", r"\\*", _readable(line))


def setup(app):
    app.connect("autodoc-process-signature", _signature)
    # After napoleon's handler, which turns the Attributes section into :type: lines.
    app.connect("autodoc-process-docstring", _escape_types, priority=600)
