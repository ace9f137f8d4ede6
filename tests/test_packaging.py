"""Import-time version check and the benchmark scripts' smoke runs."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
    [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def test_other_tensorflow_version_is_refused_with_a_clear_message():
    code = ("import tensorflow as tf; tf.__version__ = '2.20.1'\n"
            "import tf_ophandlers")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=ENV)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "supports TensorFlow 2.21.x only" in proc.stderr and "2.20.1" in proc.stderr


# Each benchmark script's smoke run: (script, extra options, strings its section contains).
BENCHMARKS = [
    ("overhead", [], ["ratio to plain"]),
    ("gradient_tape", [], ["ratio to tf.GradientTape", "keras-mlp-step", "chain-100"]),
    ("forward_accumulator", [], ["speedup (tf / this)", "add-per-op", "mlp-hvp", "chain-50"]),
    ("vectorized_map", ["--rounds", "2"], ["time / oh", "per-example-grads", "forward-batch"]),
    ("parallel", ["--rounds", "2"], ["ratio to ParallelDevice", "per-op", "mlp-step",
                                     "MirroredStrategy"]),
    ("functions", [], ["ratio to plain (this / plain)", "mlp-forward", "train-step", "small"]),
    ("lazy", [], ["speedup (eager / this)", "chain-200", "rnn-cell", "build only"]),
    ("native_handlers", [], ["vs plain", "OpCounter", "C++ pass-through"]),
]


@pytest.mark.parametrize("name,options,expected", BENCHMARKS, ids=[b[0] for b in BENCHMARKS])
def test_benchmark_quick_run(tmp_path, name, options, expected):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / ("%s.py" % name)),
                           "--quick", *options, "--out", str(out)], capture_output=True,
                          text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "<!-- %s:begin -->" % name in text
    for s in expected:
        assert s in text, s
