"""oh.ParallelHandler's data-parallel `model.fit` and an oh.Mesh training step over two
tf.distribute.Server worker processes on loopback ports (examples/two_process_training.py:
the client connects with tf.config.experimental_connect_to_cluster), each against the
same training on one device in the same run, and a checkpoint of the fit model's
per-process weights written and restored."""
import ast
import pathlib

import numpy as np
import pytest

from python_process import run_python

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _numbers(out, prefix):
    (line,) = [l for l in out.splitlines() if l.startswith(prefix)]
    return ast.literal_eval(line[len(prefix):].strip())


@pytest.mark.slow
def test_fit_and_mesh_step_over_two_server_processes_match_one_device():
    # A hang (a collective whose members never meet) is a failure: the handler's
    # collective timeout (30 s in the example) raises first, this one bounds the rest.
    proc = run_python(ROOT / "examples" / "two_process_training.py", timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    workers = ["/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)]
    assert _numbers(out, "fit weights on:") == workers
    assert _numbers(out, "mesh shards on:") == workers
    assert "checkpoint restored: True" in out  # written and read on both processes
    for what in ("fit", "mesh", "mesh fit (eager)", "mesh fit (compiled)"):
        one = _numbers(out, what + ", one device:")
        two = _numbers(out, what + ", two processes:")
        assert len(one) == len(two) >= 3 and one[-1] < one[0]
        np.testing.assert_allclose(two, one, rtol=1e-5)
        if what.startswith("mesh fit"):
            assert _numbers(out, what + " layout:") == (None, "model")
