"""Whether this machine's TensorFlow refuses channels-first (NCHW) kernels on the CPU.

TensorFlow's own CPU kernels run Conv2D and MaxPool only in NHWC ("The Conv2D op
currently only supports the NHWC tensor format on the CPU"). With oneDNN's custom ops on
(`TF_ENABLE_ONEDNN_OPTS=1`, TensorFlow's default on x86 CPUs with AVX-512 VNNI/BF16 or
AMX) both eager ops and graphs are rewritten to oneDNN's kernels, which accept NCHW, so
the same program runs. Tests that show the refusal (the premise of oh.DataFormat) check
it where it happens, and elsewhere check that the plain program runs; the handler's
results are compared with the channels-last twin on every machine.
"""
import contextlib
import functools

import pytest
import tensorflow as tf

REFUSALS = (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError)


@functools.lru_cache(maxsize=None)
def cpu_refuses_nchw():
    """True when a plain NCHW Conv2D or MaxPool on the CPU raises (probed once)."""
    x = tf.zeros([1, 1, 2, 2])
    try:
        with tf.device("CPU:0"):
            tf.nn.conv2d(x, tf.zeros([1, 1, 1, 1]), 1, "VALID", data_format="NCHW")
            tf.nn.max_pool2d(x, 1, 1, "VALID", data_format="NCHW")
    except REFUSALS:
        return True
    return False


@contextlib.contextmanager
def refused_on_cpu(errors=REFUSALS, match=None):
    """Expects `errors` where the CPU refuses NCHW. Elsewhere the block may run (oneDNN
    takes the op) or raise one of `errors` (an op oneDNN does not take, e.g. a 3-D pool)."""
    if cpu_refuses_nchw():
        with pytest.raises(errors, match=match):
            yield
    else:
        try:
            yield
        except errors:
            pass


def skip_unless_refused():
    if not cpu_refuses_nchw():
        pytest.skip("this TensorFlow runs NCHW on the CPU (oneDNN's custom ops are on: "
                    "TF_ENABLE_ONEDNN_OPTS)")
