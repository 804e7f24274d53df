"""The `.kv` checkpoint file (docs/kv-format.md): 48-byte header, u32 text length + cache text,
the DENS payload (13 u32, in version 2 a u32 per layer: the rows it holds, in version 3 three
u32 sizing the linear-attention layers' states, fingerprint, token ids, logits, per layer K
rows then V rows, in version 3 the states, xxh3-64 of the preceding payload bytes), then an
optional KTM section. All integers little-endian.
The header's payload byte count is exact; only hits (offset 12) and last-used (offset 32) ever
change after the rename. Readers never trust a size without checking it against the file size;
every rejection is a KVFileError whose `reason` is a short fixed string."""
from common.kvfile.layout import *  # noqa: F401,F403  (one namespace: `kvfile.X` for every part)
from common.kvfile.reading import *  # noqa: F401,F403
from common.kvfile.writing import *  # noqa: F401,F403
