"""`Async`: ops of the scope are queued on an asynchronous executor and control returns
to Python at once (RFC "Asynchronous execution").

>>> import tensorflow as tf, tf_ophandlers as oh
>>> with oh.Async() as runner:
...     y = tf.matmul(tf.ones([256, 256]), tf.ones([256, 256]))  # queued, returns at once
...     z = tf.reduce_sum(y)
>>> float(z)                           # a synchronization point: waits for the value
16777216.0

The handler is transparent; every op placed on it (and the ops of the handlers inside
it) is launched on TensorFlow's asynchronous eager executor owned by the handler. An
error — a bad shape, a failed check — does not interrupt the program where the op was
issued: it surfaces at the next synchronization point (`.numpy()`, printing, a Python
decision on a value, `runner.sync()`, or leaving the scope), as the TensorFlow error of
the failing op, whose message names it. After an error the executor is reset, so the
handler can be used again.
"""
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import executor as _executor

from tf_ophandlers.core.handler import OpHandler


class Async(OpHandler):
    """Runs the ops of its scope asynchronously; errors surface at synchronization.

    Args:
      sync_on_exit: wait for the queued ops (and raise their error) when the outermost
        scope of the handler closes. Default True, as a `with` block reads sequentially.
    """

    transparent = True
    replays_functions = False  # a function call is one queued op
    TYPE_NAME = "ASYNC"

    def __init__(self, sync_on_exit=True):
        self.sync_on_exit = sync_on_exit
        self._executor = _executor.new_executor(enable_async=True)
        self._saved = []
        self._depth = 0

    def debug_string(self):
        return "Async()"

    def scope_entered(self):
        # The executor is per thread: ops issued here, including those the dispatcher
        # runs for handlers inside this one, go to this executor's queue.
        ctx = _context.context()
        self._saved.append(ctx.executor)
        ctx.executor = self._executor
        self._depth += 1

    def scope_exited(self):
        self._depth -= 1
        _context.context().executor = self._saved.pop()
        if self._depth == 0 and self.sync_on_exit:
            self.sync()

    def sync(self):
        """Waits for every queued op; raises the first error of a failed op (the
        executor is then cleared, so the handler keeps working)."""
        try:
            self._executor.wait()
        finally:
            self._executor.clear_error()

    def copy_off(self, value, device):
        # A value leaving the handler (.numpy(), printing) is a synchronization point.
        self.sync()
        return value
