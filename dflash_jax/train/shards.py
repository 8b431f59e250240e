"""Token-id shards: `dflash_jax.token_shards` (outside the training package, since the n-gram
table builder reads them too); this module keeps its names importable."""

from dflash_jax.token_shards import (TokenSeq, read_manifest, read_shard, read_shards,  # noqa: F401
                                     sha256_file, summary, write_shard)
