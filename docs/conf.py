"""Sphinx configuration for the torchdi documentation (``make docs``; warnings are errors).

Sphinx rather than MkDocs: torchdi's docstrings are in the torch.func style (Google sections
plus reStructuredText literal blocks and doctests), which autodoc + napoleon render as written,
as PyTorch's own reference does; MyST lets the guides be Markdown like the README.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout, not whatever torchdi is installed
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import torchdi  # noqa: E402

project = "torchdi"
author = "the torchdi authors"
copyright = "the torchdi authors"
release = version = torchdi.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "torchdi_api",  # one reference page per name of torchdi.__all__ (docs/_ext/torchdi_api.py)
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "reference/api/_*.md"]  # generated fragments that pages include

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False  # pages come from torchdi_api, which follows torchdi.__all__
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"torchdi {release}"
html_static_path = ["_static"]
html_css_files = ["torchdi.css"]
pygments_style = "friendly"

# Every cross-reference must resolve (a renamed or removed public name fails the build), except
# types of other packages (no intersphinx: the build runs offline) and annotations that name
# torchdi's internal modules (torchdi.contexts.Context, a TypeVar), which have no page.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|collections|typing|types|builtins|os)(\..*)?"),
    (r"py:.*", r"torchdi\.(contexts|translate|prep|backends|engines|operators|runners|errors|sparsity\.index_sets|into_grad)\..*"),
]
