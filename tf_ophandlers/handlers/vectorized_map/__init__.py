"""`oh.vectorized_map`: eager batching, op by op, as an op handler.

handler.py the handler and `vectorized_map`; batching_rules.py the representation
`Batched` and the per-op batching rules."""
from tf_ophandlers.handlers.vectorized_map.handler import (
    VectorizedMap, is_list_op, vectorized_map)

__all__ = ["VectorizedMap", "is_list_op", "vectorized_map"]
