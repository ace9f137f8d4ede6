"""The lock of eager launches on chosen devices, for handlers that run an op once per
device themselves (`oh.ParallelHandler`'s components, `oh.Mesh`'s devices).

TensorFlow (2.21) mixes up the host-memory inputs (shapes, axes, sizes) of two eager ops
that run at the same time on one logical device other than the host CPU: under
``tf.device("CPU:1")`` in two threads, ``tf.zeros(shape)`` or a ``Reshape`` sometimes runs
with the other thread's shape, a wrong result or a shape error. Plain TensorFlow does it
too (two threads, nothing of this package); ops on CPU:0, or on two distinct devices at
once, do not. A handler that fans each op out to its devices would turn this into silent
wrong results for a program run from two threads, with one instance or one each, so its
per-device launches hold `LAUNCHES`: threads take turns launching (as TensorFlow's
parallel device runs each device's ops on one thread of its own).

One process-wide reentrant lock rather than one per device: a launch may run a handler
below that launches on other devices (a mesh under a parallel handler), and two threads
taking per-device locks in different orders could deadlock. A handler holds it once
around all the per-device launches of one op (one acquire and release per op when
uncontended). Not held around ops whose per-device parts wait for each other on threads
of their own (collectives): those threads could not take it.
"""
import threading

#: Held around the per-device eager launches of a multi-device handler (reentrant: a
#: launch may run nested ops, a py_function's body or a copy-off hook).
LAUNCHES = threading.RLock()
