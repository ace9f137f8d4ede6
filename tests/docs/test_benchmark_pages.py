"""The benchmark pages hold current results only: each script's run replaces its page
(docs/benchmarks/<name>.md) and its line in docs/benchmarks.md, which keeps no history."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402  pylint: disable=wrong-import-position

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
