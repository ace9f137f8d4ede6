"""Builds examples/cc_handler/op_timer.cc with the oh.sysconfig one-liner, loads it and
profiles a small Keras model's forward and backward pass per op type.

    python examples/cc_handler/op_timer.py
"""
import hashlib
import os
import subprocess
import sys
import tempfile

import tensorflow as tf
import tf_ophandlers as oh

HERE = os.path.dirname(os.path.abspath(__file__))


def build(source=os.path.join(HERE, "op_timer.cc")):
    # The output's name hashes the source, the installed public header and the flags, so a
    # library built against another version of the package (another ABI) is never reused.
    cflags, lflags = oh.sysconfig.get_compile_flags(), oh.sysconfig.get_link_flags()
    digest = hashlib.sha256()
    for path in (source, os.path.join(oh.sysconfig.get_include(), "tf_ophandlers", "handler.h")):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(repr((cflags, lflags)).encode())
    out = os.path.join(tempfile.gettempdir(), "tf_ophandlers_op_timer_%s.so" % digest.hexdigest()[:16])
    if not os.path.exists(out):
        tmp = "%s.%d.tmp" % (out, os.getpid())  # concurrent builds never see a partial file
        cmd = ["g++", "-shared", "-fPIC", "-O2"] + cflags + [source, "-o", tmp] + lflags
        subprocess.run(cmd, check=True)
        os.replace(tmp, out)
    return out


def timings(timer):
    rows = []
    for line in timer.query("timings").decode().splitlines():
        op_type, count, nanos = line.split("\t")
        rows.append((op_type, int(count), int(nanos) / 1e6))
    return sorted(rows, key=lambda r: -r[2])


def main():
    OpTimer = oh.load_handler_library(build()).OpTimer
    model = tf.keras.Sequential([tf.keras.Input([64]), tf.keras.layers.Dense(256, "relu"),
                                 tf.keras.layers.Dense(10)])
    x = tf.random.stateless_normal([128, 64], seed=[1, 2])
    timer = OpTimer()
    with timer:
        for _ in range(5):
            with oh.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)))
            grads = tape.gradient(loss, model.trainable_variables)
    want = tf.GradientTape()
    with want:
        ref = tf.reduce_mean(tf.square(model(x)))
    assert abs(float(loss) - float(ref)) < 1e-5, (float(loss), float(ref))
    assert len(grads) == 4
    print("%-24s %6s %10s" % ("op type", "count", "total ms"))
    for op_type, count, ms in timings(timer)[:8]:
        print("%-24s %6d %10.3f" % (op_type, count, ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
