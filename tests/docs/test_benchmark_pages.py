"""The benchmark pages hold current results only: each script's run replaces its page
(docs/benchmarks/<name>.md) and its line in docs/benchmarks.md, which keeps no history."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import _common  # noqa: E402  pylint: disable=wrong-import-position
from benchmark_runs import HISTORY  # noqa: E402  pylint: disable=wrong-import-position

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _body(date, figure):
    return "\n".join([
        "## `oh.Thing` vs. TensorFlow (`benchmarks/thing.py`)", "",
        "**Method.** Interleaved rounds.", "",
        "**Machine.** 2 CPU(s). Run on %s; 3 configurations, 9 s total." % date, "",
        "![time per call](thing.png)", "",
        "### Case", "", _common.md_table(["configuration", "ratio"], [["oh", figure]])])


def test_a_rerun_replaces_the_page_and_its_line(tmp_path):
    index = tmp_path / "benchmarks.md"
    index.write_text("# Benchmarks\n\nIntro.\n")
    _common.write_page("thing", _body("2026-01-02", "1.50x"), str(index))
    _common.write_page("thing", _body("2026-03-04", "1.10x"), str(index))
    page = (tmp_path / "benchmarks" / "thing.md").read_text()
    assert page.startswith("# `oh.Thing` vs. TensorFlow")
    assert "1.10x" in page and "1.50x" not in page and "2026-01-02" not in page
    assert "![time per call](../thing.png)" in page  # the plot stays beside the index
    text = index.read_text()
    assert text.count("(benchmarks/thing.md)") == 1
    assert "run on 2026-03-04" in text and "2026-01-02" not in text
    assert text.startswith("# Benchmarks\n\nIntro.")


def test_write_section_to_another_file_keeps_one_file(tmp_path):
    """The smoke runs (tests/benchmark_runs.py) pass --out and read one file back."""
    out = tmp_path / "out.md"
    _common.write_section(str(out), "thing", _body("2026-01-02", "1.50x"))
    _common.write_section(str(out), "thing", _body("2026-03-04", "1.10x"))
    text = out.read_text()
    assert "1.10x" in text and "1.50x" not in text
    assert not (tmp_path / "out").exists()


def test_the_docs_benchmark_pages_hold_only_their_run_dates():
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    for line in index.splitlines():
        if _DATE.search(line):
            assert re.fullmatch(r"- \[.*\]\(benchmarks/[\w-]+\.md\) — run on \d{4}-\d{2}-\d{2}",
                                line), line
    pages = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
    assert pages
    for page in pages:
        assert "(benchmarks/%s)" % page.name in index, "%s is not listed" % page.name
        assert len(set(_DATE.findall(page.read_text()))) <= 1, page.name
        assert len(page.read_bytes()) < 60_000, page.name


def _history(text):
    m = HISTORY.search(text)
    return None if m is None else text[max(0, m.start() - 120):m.end() + 120]


def test_the_docs_benchmark_pages_hold_no_history():
    """Issue numbers, named rounds of work, "before" figures and earlier runs belong in
    CHANGELOG.md, not on the pages of current results."""
    pages = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
    for page in pages + [ROOT / "docs" / "benchmarks.md"]:
        assert _history(page.read_text()) is None, (page.name, _history(page.read_text()))


def test_the_history_check_catches_history_and_spares_method_text():
    for text in ["Targets (issue 21):", "the issue-17 figures", "| figure | issue (before) |",
                 "Issue 20's sixth speed round", "two earlier full runs the same day",
                 "The fit rows are from a later run"]:
        assert HISTORY.search(text), text
    for text in ["7 rounds of 100 calls", "best round ms/call", "IQR of same-round ratios",
                 "after the last round", "TF's async executor (issue 14.8 µs)",
                 "control returned ms (issue)"]:
        assert HISTORY.search(text) is None, text


def test_the_shared_targets_text_names_no_issue():
    text = "\n".join(_common.targets_md(["- a target: **PASS**"], "thing", False, "thing.png",
                                        plural=True, scope=" for `case`"))
    assert "Targets for `case`, checked against this run's medians" in text
    assert _history(text) is None and "issue" not in text.lower()
