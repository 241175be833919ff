"""Checking a DCP commit's document against the commit (SPEC.md §9.4, §17): what
``shardstore.dcp.StoreReader`` refuses before a load, ``verify`` reports.
"""

from __future__ import annotations

from ..errors import ManifestError, ShardstoreError
from ..format.dcp import dcp_extra, decode_document, document_problems
from ..format.manifest import MAX_MANIFEST_BYTES
from ..store import Store
from .commits import LoadedCommit, Problem

__all__ = ["dcp_problems"]


def dcp_problems(store: Store, lc: LoadedCommit) -> list[Problem]:
    """Problems of the DCP document of ``lc`` (none for a commit without one): it decodes strictly
    and ties to the commit's entries and the extra's tensors (``format.dcp.document_problems``).
    An unreadable document object is the object checks' to report, not repeated here."""
    x = dcp_extra(lc.commit.extras)
    if x is None:
        return []
    what = f"commit {lc.id}: DCP document {x.state}"
    try:
        doc = decode_document(store.get(x.state, limit=MAX_MANIFEST_BYTES), what)
    except ManifestError as e:
        return [Problem(e, lc.id, x.state)]
    except ShardstoreError:
        return []  # missing or corrupt: reported by the object checks
    return [
        Problem(ManifestError(f"{what}: {msg} (SPEC.md §9.4)"), lc.id, x.state)
        for msg in document_problems(doc, lc.entries(), x.tensors)
    ]
