"""The shape of a KV checkpoint: what a `.kv` payload's head says (docs/kv-format.md section 4)
and what a SaveCheckpoint carries from inference to the persister. One definition for both,
so no process rebuilds it field by field."""
from __future__ import annotations

import msgspec


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """Payload fields 2..6 and 8..12 (field 7, the token count, belongs to the checkpoint),
    and the per-layer sliding windows of the model.

    windows: per layer, the window W in tokens of a sliding-window layer, 0 for a global
    layer; () when every layer is global (dense models, payload version 1). A payload holds,
    for n tokens, the last min(n, W) rows of a windowed layer (all a continuation from
    position n attends to) and all n rows of a global one. A file stores those row counts,
    not the windows: a Geometry read back from a file has windows () (see kvfile.read)."""
    ctx_size: int
    chunk_size: int
    kv_capacity: int
    sliding_window: int = 0            # field 5: the largest of windows (0 = full attention)
    compressed_capacity: int = 0
    n_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: int
    windows: tuple[int, ...] = ()
    # models with linear-attention layers (payload version 3): how many, and per layer the
    # values of its convolution's inputs (stored in the KV dtype) and of its recurrent state
    # (f32); n_layers counts the attention layers only, the ones holding K/V rows
    state_layers: int = 0
    conv_values: int = 0
    ssm_values: int = 0

    @property
    def state_bytes(self) -> int:
        """Bytes of a checkpoint's recurrent states (0 without linear-attention layers)."""
        return self.state_layers * (self.conv_values * (4 if self.kv_dtype == 0 else 2) + 4 * self.ssm_values)

    @property
    def windowed(self) -> bool:
        """Some layer has a sliding window: checkpoints use payload version 2."""
        return any(self.windows)

    def rows(self, n_tokens: int) -> tuple[int, ...]:
        """Rows per layer that a checkpoint of n_tokens holds (positions n - rows .. n - 1)."""
        if not self.windows:
            return (n_tokens,) * self.n_layers
        return tuple(min(n_tokens, w) if w else n_tokens for w in self.windows)
