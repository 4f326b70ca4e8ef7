"""Sphinx configuration of the flax_ringattn documentation (MyST Markdown, sphinx-book-theme, autodoc).

Build with `make docs` (warnings are errors)."""

from __future__ import annotations

import os
import pathlib
import sys

# autodoc imports the package: from this checkout, on 8 simulated CPU devices like the pages' code.
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax_ringattn  # noqa: E402

project = "flax_ringattn"
author = "the flax_ringattn authors"
copyright = "2026, the flax_ringattn authors"  # noqa: A001
release = flax_ringattn.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = ["api_names.rst"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Docstrings use the project's own light markup (backticked names, shape letters), not reST cross-references.
default_role = "code"
suppress_warnings = ["myst.xref_missing"]

html_theme = "sphinx_book_theme"
html_title = f"flax_ringattn {release}"
html_theme_options = {
  "repository_url": "https://github.com/flax-ringattn/flax_ringattn",
  "use_repository_button": False,
  "show_toc_level": 2,
}
