"""shardstore as a ``torch.distributed.checkpoint`` storage layer (SPEC.md §9.4).

``StoreWriter`` (``writer``) makes each ``dcp.save`` / ``dcp.async_save`` a commit whose ref
moves by compare-and-swap only once every rank's data is durable; ``StoreReader`` (``reader``)
serves ``dcp.load`` into any split, reading only the blocks each rank's load plan overlaps,
every byte verified. ``metadata`` converts DCP's ``Metadata`` to and from the canonical DCP
document (``format.dcp``); ``handle`` names a store so that a writer can cross into DCP's
checkpoint process. Importing this package imports torch.distributed.checkpoint.
"""

from .reader import StoreReader
from .writer import StoreWriter

__all__ = ["StoreReader", "StoreWriter"]
