"""Sphinx configuration of the dsq-plugins site (``make docs``).

Pages are Markdown (MyST); the API reference is generated from the
docstrings (autodoc, napoleon). ``nitpicky``: a reference to a name that
does not exist fails the build (``make docs`` turns warnings into errors).
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "dsq-plugins"
author = "the dsq-plugins developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "*.json"]
html_theme = "furo"
html_title = "dsq-plugins"

myst_heading_anchors = 4
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # types are in the signatures of the source; the prose says what each takes
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nitpicky = True
# names outside this project (torch, the engines, the standard library) are not documented here
nitpick_ignore_regex = [(r"py:.*", r"(torch|typing|collections|concurrent|contextlib|dataclasses|enum|io|os|"
                                   r"pathlib|threading|logging|numpy|deepspeed|horovod|transformers|accelerate|"
                                   r"lightning|pytorch_lightning|builtins)(\..*)?"),
                        (r"py:class", r"(Any|Callable|Iterable|Iterator|Sequence|Mapping|Optional|Union|Tuple|"
                                      r"Dict|List|Type|TypeVar|Protocol|ClassVar|T|Self|optional|callable|"
                                      r"iterable|NoneType|ellipsis|Tensor|Module|Optimizer|ProcessGroup|"
                                      r"GradBucket|Future)"),
                        (r"py:class", r"dist\..*|horovod_ext\.compression\.(None|FP16|BF16)Compressor|_Board|"
                                      r"dsq_plugins\.optim\._freeze\.FreezesVariance")]
