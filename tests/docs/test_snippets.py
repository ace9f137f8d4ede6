"""Every fenced Python block of README.md and docs/ runs (Sybil parses and evaluates
them). The blocks of one page share a namespace and run in order, as a reader runs them;
a block that cannot run in the test process is preceded by
`<!-- skip: next "reason" -->`, and the reason is required."""
import pathlib
import re
import unittest

import pytest
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = pathlib.Path(__file__).resolve().parents[2]
# docs/pending/ holds text other changes will place in pages; it runs once placed.
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if "pending" not in p.parts)
_SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])
_FENCE = re.compile(r"^```\s*(python|py|python3|pycon)\b", re.M)
_SKIP = re.compile(r"<!--\s*skip:\s*next\b(.*?)-->", re.S)


def _with_python(pages):
    return [p for p in pages if _FENCE.search(p.read_text())]


@pytest.mark.parametrize("page", _with_python(PAGES),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page):
    document = _SYBIL.parse(page)
    ran = skipped = 0
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest:
            skipped += 1
            continue
        except Exception as e:
            raise AssertionError("%s, block at line %d failed: %r" % (
                page.relative_to(ROOT), example.line, e)) from e
        ran += 1
    assert ran, "no block of %s ran" % page


@pytest.mark.parametrize("page", _with_python(PAGES),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_is_collected(page):
    """Sybil finds every ```python fence (a fence it missed would silently not run), and
    every skipped block says why."""
    text = page.read_text()
    fences = _FENCE.findall(text)
    assert all(f == "python" for f in fences), "use ```python fences in %s" % page
    blocks = [r for _, r in _SYBIL.parse(page).regions if not isinstance(r.evaluator, Skipper)]
    assert len(blocks) == len(fences), (page, len(blocks), len(fences))
    for reason in _SKIP.findall(text):
        assert re.search(r'"[^"]{10,}"', reason), "a skip needs a reason: %r" % reason
