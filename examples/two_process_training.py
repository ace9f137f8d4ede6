"""Training over two TensorFlow server processes on this machine (loopback ports):
data-parallel `model.fit` with `oh.ParallelHandler` (and a checkpoint of its per-process
weights), a Megatron-style sharded step with `oh.Mesh` and Keras's `fit` on that mesh,
each with the losses of the same training on one device.

The script starts two `tf.distribute.Server` worker processes (itself, with `--serve`),
connects to them with `tf.config.experimental_connect_to_cluster`, and uses their CPUs
`/job:worker/replica:0/task:0/device:CPU:0` and `.../task:1/...` as the handlers'
devices: every op of the scope runs in the worker processes, the client only dispatches.

    python examples/two_process_training.py
"""
import os
import socket
import subprocess
import sys
import tempfile


def serve(addresses, index):
    """A worker: a TensorFlow server for task `index` until the client goes away."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    cluster = tf.train.ClusterSpec({"worker": addresses})
    tf.distribute.Server(cluster, job_name="worker", task_index=index, start=True)
    print("ready", flush=True)
    sys.stdin.read()  # returns when the client's end of the pipe closes (it exited)
    os._exit(0)  # the server has no stop(): end the process  # pylint: disable=protected-access


def start_workers(n):
    """`n` worker processes on free loopback ports: their addresses and processes."""
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addresses = ["127.0.0.1:%d" % p for p in ports]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve",
                               ",".join(addresses), str(i)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a worker process did not start (exit code %s)" % p.poll())
    return addresses, procs


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    addresses, workers = start_workers(2)  # noqa: F841  (they live as long as this process)

    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tf_ophandlers as oh  # pylint: disable=import-outside-toplevel

    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({"worker": addresses}))
    devices = ["/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)]
    rng = np.random.default_rng(0)

    # -- (a) data-parallel model.fit: each process trains on half of every batch --------
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = rng.standard_normal((64, 1)).astype(np.float32)

    def make_model():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    one = make_model()
    one_losses = one.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    # timeout_seconds: a worker that dies makes the gradient all-reduce raise, not hang.
    parallel = oh.ParallelHandler(devices, timeout_seconds=30)
    with parallel:  # build and compile in the scope: weights and optimizer per process
        model = make_model()
        losses = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    print("fit, one device:   ", np.round(one_losses.history["loss"], 6).tolist())
    print("fit, two processes:", np.round(losses.history["loss"], 6).tolist())
    kernel = parallel.unpack(model.trainable_variables[0].value)
    print("fit weights on:", [t.device for t in kernel])
    np.testing.assert_allclose(losses.history["loss"], one_losses.history["loss"], rtol=1e-5)
    for got in kernel:
        np.testing.assert_allclose(got, one.trainable_variables[0].numpy(), rtol=1e-4,
                                   atol=1e-6)

    # A checkpoint holds each process's weights and optimizer state (component_0, _1).
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    saved = [[t.numpy() for t in parallel.unpack(v.value)] for v in model.weights]
    with parallel:
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # moves them
    checkpoint.read(path).assert_consumed()
    restored = [[t.numpy() for t in parallel.unpack(v.value)] for v in model.weights]
    print("checkpoint restored:", all(np.array_equal(a, b) for s, r in zip(saved, restored)
                                      for a, b in zip(s, r)))

    # -- (b) a mesh over the two processes: the hidden layer split between them ---------
    mesh = oh.Mesh({"model": 2}, devices)
    x0 = rng.standard_normal((8, 8)).astype(np.float32)
    y0 = rng.standard_normal((8, 4)).astype(np.float32)
    w10 = (rng.standard_normal((8, 16)) * .3).astype(np.float32)
    w20 = (rng.standard_normal((16, 4)) * .3).astype(np.float32)

    @tf.function
    def step(x, y, w1, w2):
        with tf.GradientTape() as tape:
            err = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y
            loss = tf.reduce_mean(err * err)
        g1, g2 = tape.gradient(loss, [w1, w2])
        w1.assign_sub(0.1 * g1)
        w2.assign_sub(0.1 * g2)
        return loss

    with mesh:  # columns of w1 and rows of w2 on each process (no copy of the other's)
        w1 = tf.Variable(mesh.shard(w10, (None, "model")))
        w2 = tf.Variable(mesh.shard(w20, ("model", None)))
    r1, r2 = tf.Variable(w10), tf.Variable(w20)
    mesh_losses, one_losses = [], []
    for _ in range(5):
        with mesh:  # the traced step replayed on the shards: one function per process
            mesh_losses.append(float(step(x0, y0, w1, w2)))
        one_losses.append(float(step(x0, y0, r1, r2)))
    print("mesh, one device:   ", np.round(one_losses, 6).tolist())
    print("mesh, two processes:", np.round(mesh_losses, 6).tolist())
    print("mesh shards on:", [s.device for s in mesh.unpack(w1.value())])
    np.testing.assert_allclose(mesh_losses, one_losses, rtol=1e-5)
    np.testing.assert_allclose(w1.numpy(), r1.numpy(), rtol=1e-4, atol=1e-6)
    assert not mesh.fallbacks, mesh.fallbacks

    # -- (c) Keras's fit on the mesh, the hidden layer split between the processes -----
    for run_eagerly in (True, False):
        def make_mesh_model():
            model = make_model()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                          run_eagerly=run_eagerly)
            return model

        one_losses = make_mesh_model().fit(x, y, batch_size=16, epochs=3, shuffle=False,
                                           verbose=0).history["loss"]
        with mesh:  # the dataset stays on the first process; batches are copied to both
            model = make_mesh_model()
            hidden, out = model.layers
            mesh.shard_variable(hidden.kernel, (None, "model"))
            mesh.shard_variable(hidden.bias, ("model",))
            mesh.shard_variable(out.kernel, ("model", None))
            losses = model.fit(x, y, batch_size=16, epochs=3, shuffle=False,
                               verbose=0).history["loss"]
        what = "mesh fit (%s)" % ("eager" if run_eagerly else "compiled")
        print(what + ", one device:   ", np.round(one_losses, 6).tolist())
        print(what + ", two processes:", np.round(losses, 6).tolist())
        print(what + " layout:", mesh.layout_of(hidden.kernel))
        np.testing.assert_allclose(losses, one_losses, rtol=1e-5)

if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2].split(","), int(sys.argv[3]))
    else:
        main()
