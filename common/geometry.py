"""The shape of a KV checkpoint: what a `.kv` payload's head says (docs/kv-format.md section 4)
and what a SaveCheckpoint carries from inference to the persister. One definition for both,
so no process rebuilds it field by field."""
from __future__ import annotations

import msgspec


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """Payload fields 2..6 and 8..12 (field 7, the token count, belongs to the checkpoint)."""
    ctx_size: int
    chunk_size: int
    kv_capacity: int
    sliding_window: int = 0
    compressed_capacity: int = 0
    n_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: int
