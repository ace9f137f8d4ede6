"""The documentation's size limits and its API reference's coverage (`make docs` builds
the site itself, with mkdocs --strict, in CI)."""
import importlib.util
import pathlib

import tf_ophandlers as oh

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_is_an_entry_point_and_no_page_is_huge():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024
    for page in (ROOT / "docs").rglob("*.md"):
        assert len(page.read_bytes()) <= 60 * 1024, page


def test_the_api_reference_lists_every_public_name():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.public_names() == list(oh.__all__)
    page = hooks.on_page_markdown((ROOT / "docs" / "api.md").read_text(), page=None)
    for name in oh.__all__:
        assert "::: tf_ophandlers.%s\n" % name in page + "\n", name
