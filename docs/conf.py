"""Sphinx configuration of ``make docs``: docs/*.md plus an API reference from the docstrings.

The build runs with ``-W --keep-going -n``: every warning, and every cross-reference that does
not resolve, fails it. Nothing is fetched (no intersphinx), so types of other libraries are
listed in ``nitpick_ignore_regex`` instead of linked.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docstrings import prepare_docstring

import attnsdk

if TYPE_CHECKING:
    from docutils.nodes import Element, TextElement
    from sphinx.application import Sphinx
    from sphinx.environment import BuildEnvironment

project = "attnsdk"
release = version = attnsdk.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "alabaster"

autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "show-inheritance": True,
    "exclude-members": "model_config",
}
autodoc_member_order = "bysource"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True

# Named in signatures but documented elsewhere: the standard library, torch, pydantic and its
# annotated_types, the engines' types (only imported under TYPE_CHECKING, so they stay bare
# names), and attnsdk's private helper types (a name starting with "_").
nitpick_ignore_regex = [
    (
        "py:.*",
        r"(os|collections|random|typing|enum|torch|pydantic|annotated_types|hypothesis|_pytest|pytest)\..*",
    ),
    ("py:.*", r"BaseModel|SerializeAsAny|Factory|ForwardBatch|ModelRunner|RadixAttention"),
    ("py:.*", r"attnsdk\..*\._\w+(\.\w+)*"),
    # autodoc renders a dataclass field's default_factory signature of a subscripted type
    # (MockCompilationConfig's ``dict[str, Any]``) as the fragment "'dict[str".
    ("py:class", r"'dict\[str"),
]


def _public_name(app: Sphinx, env: BuildEnvironment, node: Element, contnode: TextElement) -> Any:
    """Resolve ``attnsdk.contract.kv.KVCache`` (the defining module, which signatures name) to
    ``attnsdk.KVCache`` (the public name this reference documents)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module, _, name = target.rpartition(".")
    parts = module.split(".")
    private = [i for i, part in enumerate(parts) if part.startswith("_")]
    if parts[0] == "attnsdk" and private:
        target = ".".join([*parts[: private[0]], name])
    elif not module:
        # A bare name from a string annotation ("PageOrder" in another module's signature):
        # the one documented object of that name, if there is exactly one.
        found = [n for n in env.get_domain("py").objects if n.rpartition(".")[2] == name]
        target = found[0] if len(found) == 1 else target
    # "obj" matches any object type: a Literal alias such as PageOrder is documented as data.
    return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, "obj", target, node, contnode
    )


def _public_bases(app: Sphinx, name: str, obj: object, options: object, bases: list[type]) -> None:
    """Show a private base class (``_FieldError``) as the public classes it derives from."""
    for i, base in reversed(list(enumerate(bases))):
        if base.__name__.startswith("_"):
            bases[i : i + 1] = list(base.__bases__)


def _defining_docstring(
    app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """Show the docstring written where an object is defined: under a constant that a public
    module re-exports (``SGLANG_VERSIONS``), and on the implementation class of a drop-in class
    built at run time (``SGLangAttentionBackend``)."""
    if what == "class" and not lines and isinstance(obj, type):
        lines[:] = prepare_docstring(inspect.getdoc(obj) or "")
    if what != "data":
        return
    attr = name.rpartition(".")[2]
    for modname, module in sorted(sys.modules.items()):
        if modname.startswith("attnsdk.") and getattr(module, attr, None) is obj:
            doc = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", attr))
            if doc:
                lines[:] = list(doc)
                return


def setup(app: Sphinx) -> None:
    app.connect("missing-reference", _public_name)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-docstring", _defining_docstring)
