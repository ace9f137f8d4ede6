"""MkDocs hook: the API reference lists every name of `tf_ophandlers.__all__`.

`api.md` holds the marker `<!-- api:names -->`; this hook replaces it with one
mkdocstrings directive per public name, read from the package's `__init__.py` (parsed,
not imported), so a name added to `__all__` gets its page entry without an edit here.
"""
import ast
import os

_INIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "tf_ophandlers", "__init__.py")


def public_names():
    tree = ast.parse(open(_INIT).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    raise RuntimeError("tf_ophandlers/__init__.py has no __all__")


def on_page_markdown(markdown, page, **kwargs):
    if "<!-- api:names -->" not in markdown:
        return markdown
    blocks = ["::: tf_ophandlers.%s" % name for name in public_names()]
    return markdown.replace("<!-- api:names -->", "\n\n".join(blocks))
