"""tf.linalg.eigh / eigvalsh in oh.vectorized_map with the loop fallback off, against
tf.vectorized_map (SelfAdjointEigV2 without eigenvectors failed in the
map's pfor conversion)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_ophandlers as oh
from conftest import assert_same_tensors

_X = tf.constant(np.random.default_rng(5).standard_normal((3, 4, 4)).astype(np.float32))
SYM = _X + tf.transpose(_X, [0, 2, 1])

FUNCTIONS = {
    "eigvalsh": tf.linalg.eigvalsh,
    "eigh_values": lambda m: tf.linalg.eigh(m)[0],
    # eigenvectors up to sign: compare squares
    "eigh_vectors": lambda m: tf.linalg.eigh(m)[1] ** 2,
    "eigvalsh_of_shared_plus_example": lambda m: tf.linalg.eigvalsh(m + SYM[0]),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_values_without_the_loop_fallback(name):
    fn = FUNCTIONS[name]
    want = tf.vectorized_map(fn, SYM, fallback_to_while_loop=False)
    assert_same_tensors(want, oh.vectorized_map(fn, SYM, fallback_to_while_loop=False),
                        tol=1e-4)


def test_eigvalsh_gradient_under_oh_gradient_tape():
    def run(vmap, tape_type):
        with tape_type() as tape:
            tape.watch(SYM)
            loss = tf.reduce_sum(vmap(tf.linalg.eigvalsh, SYM) ** 2)
        return tape.gradient(loss, SYM)

    assert_same_tensors(run(tf.vectorized_map, tf.GradientTape),
                        run(oh.vectorized_map, oh.GradientTape), tol=1e-4)
