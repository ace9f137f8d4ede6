"""Import-time version check and the benchmark scripts' smoke runs."""
import os
import pathlib
import subprocess
import sys

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


def test_overhead_benchmark_quick_run(tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "<!-- overhead:begin -->" in text and "ratio to plain" in text



def test_gradient_tape_benchmark_quick_run(tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gradient_tape.py"),
                           "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "<!-- gradient_tape:begin -->" in text and "ratio to tf.GradientTape" in text
    assert "keras-mlp-step" in text and "chain-100" in text


def test_forward_accumulator_benchmark_quick_run(tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable,
                           str(ROOT / "benchmarks" / "forward_accumulator.py"),
                           "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "<!-- forward_accumulator:begin -->" in text and "speedup (tf / this)" in text
    assert "add-per-op" in text and "mlp-hvp" in text and "chain-50" in text


def test_vectorized_map_benchmark_quick_run(tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vectorized_map.py"),
                           "--quick", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "<!-- vectorized_map:begin -->" in text and "time / oh" in text
    assert "per-example-grads" in text and "forward-batch" in text


def test_parallel_benchmark_quick_run(tmp_path):
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel.py"),
                           "--quick", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "<!-- parallel:begin -->" in text and "ratio to ParallelDevice" in text
    assert "per-op" in text and "mlp-step" in text and "MirroredStrategy" in text
