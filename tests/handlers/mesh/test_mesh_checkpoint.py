"""Per-shard checkpoints of oh.Mesh variables (mesh.save_shards / restore_shards): each
device writes its own blocks; restored onto the same mesh and layout per device, and onto
another layout or mesh through the full value; compared with the values saved."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_close

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


def _values():
    rng = np.random.default_rng(5)
    return (rng.normal(size=(4, 6)).astype("float32"),
            rng.normal(size=(8, 2)).astype("float32"))


def test_each_device_writes_its_own_blocks_and_reads_them_back(tmp_path):
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES)
    w0, e0 = _values()
    with mesh:
        w = tf.Variable(mesh.shard(w0, (None, "model")))      # replicated over "batch"
        e = tf.Variable(mesh.shard(e0, ("batch", "model")))   # four distinct blocks
    prefix = str(tmp_path / "ckpt")
    mesh.save_shards(prefix, {"w": w, "e": e})
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".index"))
    assert files == ["ckpt-%d-of-4.index" % i for i in range(4)]
    # Device 0's file holds its blocks only (w's block 0 and e's block (0, 0)).
    reader = tf.train.load_checkpoint(prefix + "-0-of-4")
    assert reader.get_tensor("w/shard_0").shape == (4, 3)
    assert_close(reader.get_tensor("e/shard_0"), e0[:4, :1], 0)
    # w's second "batch" row of devices holds the same blocks: saved once (devices 0, 1).
    assert not tf.train.load_checkpoint(prefix + "-2-of-4").has_tensor("w/shard_2")
    with mesh:
        w.assign(tf.zeros_like(w0))
        e.assign(tf.zeros_like(e0))
    mesh.restore_shards(prefix, {"w": w, "e": e})
    assert_close(mesh.unshard(w), w0, 0)
    assert_close(mesh.unshard(e), e0, 0)
    assert mesh.layout_of(w) == (None, "model") and mesh.layout_of(e) == ("batch", "model")
    assert [s.shape.as_list() for s in mesh.unpack(tf.identity(e))] == [[4, 1]] * 4
    assert not mesh.fallbacks


@pytest.mark.parametrize("dims, layout", [
    ({"batch": 2, "model": 2}, ("model", None)),     # same mesh, another layout
    ({"x": 4}, ("x", None)),                          # another mesh
    ({"model": 2}, ("model", None))])                 # fewer devices
def test_restore_onto_another_layout_or_mesh(tmp_path, dims, layout):
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES)
    w0, _ = _values()
    with mesh:
        w = tf.Variable(mesh.shard(w0, ("batch", "model")))
    prefix = str(tmp_path / "ckpt")
    mesh.save_shards(prefix, {"w": w})
    other = oh.Mesh(dims, DEVICES[:int(np.prod(list(dims.values())))])
    with other:
        v = tf.Variable(other.shard(np.zeros_like(w0), layout))
    other.restore_shards(prefix, {"w": v})
    assert_close(other.unshard(v), w0, 0)
    assert other.layout_of(v) == layout


def test_checkpoint_errors_name_the_mesh_and_the_variable(tmp_path):
    mesh = oh.Mesh({"batch": 2, "model": 2}, DEVICES)
    w0, e0 = _values()
    with mesh:
        w = tf.Variable(mesh.shard(w0, (None, "model")))
        e = tf.Variable(mesh.shard(e0, ("batch", None)))
    prefix = str(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="save_shards.*not a variable of Mesh"):
        mesh.save_shards(prefix, {"w": tf.Variable(w0)})
    mesh.save_shards(prefix, {"w": w})
    with pytest.raises(KeyError, match="'e' is not in the checkpoint"):
        mesh.restore_shards(prefix, {"e": e})
    with pytest.raises(ValueError, match="'w' was saved as float32 \\[4, 6\\]"):
        mesh.restore_shards(prefix, {"w": e})
    with pytest.raises(FileNotFoundError, match="restore_shards: no checkpoint"):
        mesh.restore_shards(str(tmp_path / "missing"), {"w": w})
