"""Background runs of the benchmark scripts' `--quick` smoke runs (tests/test_packaging.py).

Each run is a subprocess that mostly waits on TensorFlow kernels and imports, while the
main pytest process is mostly single-threaded Python: started when collection finishes
(conftest.py's `pytest_collection_finish`), one at a time at lower priority with one
intra-op thread, they overlap with the rest of the suite instead of adding ~5 minutes
at its end. A test waits for its own script's result.

Under pytest-xdist the controller, which runs no test, starts the runs when its workers
have collected (`pytest_xdist_node_collection_finished`) and publishes each result as a
file in a directory it names to every worker (`SHARED_DIR_KEY` in the workers' input); a
worker's test reads its script's result from there. Started from a worker instead, the
runs would go one after another at the end of that worker's share.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
    [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
# Fewer threads: the smoke runs check that a script runs and writes its section, not its
# figures, and they share the cores with the rest of the suite.
ENV.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
TIMEOUT = 600

# History in a benchmark page: issue numbers, named rounds of work, "before" figures and
# earlier runs belong in CHANGELOG.md; a page holds its current run only. (Measurement
# rounds, "7 rounds", "best round", "same-round ratios", are method, not history; nor is
# "issue" as in issuing ops, followed by a duration in µs.)
HISTORY = re.compile(
    r"\bissue[- ]?\d+(?![.\d]*\s*[µm]s)|\bissue'?s (?:figure|CNN|size)|\bthe issue measured|"
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|previous|earlier|"
    r"speed|profiling) (?:speed )?round\b|\bthis round\b|\(before\)|\bbefore the round\b|"
    r"\bearlier (?:full )?runs?\b|\blater runs?\b|\bnext run\b", re.I)

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
    ("recompute", ["--layers", "16", "--batch", "64"], ["memory vs oh tape",
                                                        "tf.recompute_grad", "memory_budget"]),
    ("small_ops", ["--rounds", "1"], ["fresh oh.Lazy() chain16", "Lazy(jit_compile=True)",
                                      "vectorized_map", "| figure | target | this run |"]),
    ("native_handlers", [], ["vs plain", "OpCounter", "C++ pass-through"]),
    ("lazy_chunks", ["--rounds", "2"], ["chunk_ops=32", "intra-op threads"]),
    ("mesh", [], ["CPU time oh.Mesh / DTensor", "Megatron MLP training step",
                  "compiled / run_eagerly"]),
    ("mesh_communication", [], ["alternative / explicit", "CollectiveAllReduce"]),
]
OPTIONS = {name: options for name, options, _ in BENCHMARKS}


class _Run:
    def __init__(self, name):
        self.name = name
        self.done = threading.Event()
        self.returncode, self.stderr, self.text = None, "", ""
        self.files = set()  # what the run left next to its page (its plot)


_runs = {}
_lock = threading.Lock()
_outdir = None
# Set in an xdist worker: the controller's directory of published results.
_shared_dir = None
SHARED_DIR_KEY = "oh_benchmark_runs_dir"


def _run_one(run):
    out = pathlib.Path(_outdir) / ("%s.md" % run.name)
    cmd = [sys.executable, str(ROOT / "benchmarks" / ("%s.py" % run.name)), "--quick",
           *OPTIONS[run.name], "--out", str(out)]
    try:
        run.returncode, run.stderr = _run_niced(cmd)
        run.text = out.read_text() if out.exists() else ""
        run.files = {f.name for f in out.parent.glob(run.name + ".*")}
    except Exception as e:  # pylint: disable=broad-except
        run.returncode, run.stderr = -1, "%s: %s" % (type(e).__name__, e)
    finally:
        run.done.set()
        if _publish:
            _write_result(run)


_publish = False  # in an xdist controller: write each result for the workers


def _shared_file(directory, name, kind):
    """A run's file in the controller's directory: "queued" (the controller started it)
    or "result.json" (its result)."""
    return pathlib.Path(directory) / ("%s.%s" % (name, kind))


def _make_outdir():
    """The directory the runs write their pages in (call with `_lock` held)."""
    global _outdir  # pylint: disable=global-statement
    if _outdir is None:
        _outdir = tempfile.mkdtemp(prefix="tfoh-bench-")
    return _outdir


def _write_result(run):
    """Publishes `run`'s result for the xdist workers; the rename makes it appear whole."""
    path = _shared_file(_outdir, run.name, "result.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"returncode": run.returncode, "stderr": run.stderr,
                               "text": run.text, "files": sorted(run.files)}))
    os.replace(tmp, path)


def shared_dir():
    """In an xdist controller: the directory the results will be published in (created
    now, before the workers start, so that it can be named in their input)."""
    global _publish  # pylint: disable=global-statement
    with _lock:
        _publish = True
        return _make_outdir()


def use_shared_dir(directory):
    """In an xdist worker: read results from the controller's `directory`."""
    global _shared_dir  # pylint: disable=global-statement
    _shared_dir = directory


def _run_niced(cmd):
    """(return code, stderr) of `cmd` run at a lower priority. The priority is set from
    this process after the fork, not by a `preexec_fn`: that runs Python in the forked
    child of a process with TensorFlow's threads, where a garbage collection can finalize
    a TensorFlow object (an eager Executor's __del__) and crash the child before it
    starts the script (return code -11)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=ENV, cwd=ROOT) as proc:
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + 5)
        except OSError:
            pass  # (it already exited: its result tells)
        try:
            _, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return proc.returncode, stderr


def start(names):
    """Starts the runs of `names` (benchmark script names) in one background thread."""
    with _lock:
        names = [n for n in names if n in OPTIONS and n not in _runs]
        if not names:
            return
        outdir = _make_outdir()
        runs = [_runs.setdefault(n, _Run(n)) for n in names]
        if _publish:  # (before the workers run a test: scheduling follows collection)
            for n in names:
                _shared_file(outdir, n, "queued").touch()

    def worker():
        for run in runs:
            _run_one(run)
    threading.Thread(target=worker, daemon=True, name="benchmark smoke runs").start()


def _published(name):
    """Waits for the controller's result of `name` (an xdist worker)."""
    path = _shared_file(_shared_dir, name, "result.json")
    deadline = time.monotonic() + TIMEOUT * len(BENCHMARKS)
    while not path.exists():
        assert time.monotonic() < deadline, "%s: the smoke run did not finish" % name
        time.sleep(0.5)
    data = json.loads(path.read_text())
    run = _Run(name)
    run.returncode, run.stderr, run.text = data["returncode"], data["stderr"], data["text"]
    run.files = set(data["files"])
    run.done.set()
    return run


def result(name):
    """Waits for `name`'s run (starting it now if collection did not) and returns it."""
    if _shared_dir is not None and _shared_file(_shared_dir, name, "queued").exists():
        return _published(name)
    start([name])  # (also a worker's, when its controller did not start this run)
    run = _runs[name]
    # The runs before it in the queue may still be going: wait for all of them.
    assert run.done.wait(TIMEOUT * len(_runs)), "%s: the smoke run did not finish" % name
    return run
