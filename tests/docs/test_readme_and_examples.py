"""The README's example and the examples/ scripts run as documented."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(code_or_path, timeout=240):
    # The checkout on the path: the scripts must work installed or not.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    args = [sys.executable, str(code_or_path)] if isinstance(code_or_path, pathlib.Path) \
        else [sys.executable, "-c", code_or_path]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_readme_example_runs_and_prints_what_it_says():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("1 ['Fill', 'CheckNumericsV2', 'Fill'")
    assert "MatMul" in first


@pytest.mark.parametrize("script", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_example_runs(script):
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
