"""Every repository path and module the README and the documentation pages name exists:
files are moved (a handler module into its family's subpackage, a test into
tests/compositions/), and a page still naming the old place sends its reader nowhere.
Paths are read from inline code spans (`core/stack.py`) and Markdown link targets;
fenced blocks hold user programs (`my_handler.cc`) and are not read."""
import importlib
import pathlib
import re

import pytest

import tf_ophandlers

ROOT = pathlib.Path(__file__).resolve().parents[2]
# docs/pending/ holds text other changes will place in pages, with the paths of then.
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if "pending" not in p.parts)
# The short forms the pages use: `core/stack.py`, `handlers/mesh/rules.py`,
# `mesh/comm.py`, `fast_path.h`, `tf_ophandlers/handler.h` (installed from cc/include).
BASES = ["", "tf_ophandlers/", "tf_ophandlers/handlers/", "cc/", "cc/include/"]
# Directories searched for a page's bare file names (`test_fuzz_stacks.py`).
SOURCE_DIRS = ["tf_ophandlers", "tests", "benchmarks", "examples", "cc", "docs", "scripts"]
# Paths in TensorFlow's source tree, not in this repository.
FOREIGN = ("tensorflow/",)
# Names that are not this repository's files, by what they are.
NOT_FILES = {
    "TensorFlow's C headers": {"tf_status.h", "tf_buffer.h", "tf_datatype.h", "tf_tensor.h",
                               "c_api_experimental.h"},
    "the layout the structure test refuses (docs/architecture.md)": {"mesh_rules.py"},
}
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|h|cc|c|toml|yml|txt|sh))"
                   r"(?![\w/(])")
_MODULE = re.compile(r"(?<![\w.])tf_ophandlers(?:\.\w+)+")


def _source_names():
    names = {p.name for p in ROOT.iterdir() if p.is_file()}
    for d in SOURCE_DIRS:
        names.update(p.name for p in (ROOT / d).rglob("*") if p.is_file())
    return names


def _references(page):
    # A fenced block becomes as many empty lines, so line numbers stay the page's.
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    for line_no, line in enumerate(text.splitlines(), 1):
        for span in _CODE.findall(line):
            for path in _PATH.findall(span):
                yield line_no, "path", path
            for module in _MODULE.findall(span):
                yield line_no, "module", module
        for target in _LINK.findall(line):
            if "://" not in target and not target.startswith("mailto:"):
                yield line_no, "link", target


def _module_exists(dotted):
    """`tf_ophandlers.handlers.mesh.handler.Mesh`: each part an attribute of the one
    before or a submodule of it."""
    obj, name = tf_ophandlers, "tf_ophandlers"
    for part in dotted.split(".")[1:]:
        name += "." + part
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(name)
        except ImportError:
            return False
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    sources = _source_names()
    missing = []
    for line_no, kind, ref in _references(page):
        if kind == "module":
            ok = _module_exists(ref)
        elif kind == "link":
            ok = (page.parent / ref).exists()
        elif ref.startswith(FOREIGN) or any(ref in names for names in NOT_FILES.values()):
            continue
        elif "/" in ref:
            ok = any((ROOT / (base + ref)).exists() for base in BASES) or (
                page.parent / ref).exists()
        else:
            ok = ref in sources
        if not ok:
            missing.append("%s:%d: %s" % (page.relative_to(ROOT), line_no, ref))
    assert not missing, "\n".join(missing)
