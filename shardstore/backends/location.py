"""Which backend a store URL names (SPEC.md §Storage): the one place that knows every
backend, above them all (as restic's location registry sits above its backends).
"""

from __future__ import annotations

import fsspec

from ..errors import StorageError
from .base import Storage
from .fsspec import FsspecStorage
from .local import LocalStorage
from .options import check_s3_options, resolve

__all__ = ["open_storage"]


def open_storage(url: str, **storage_options: object) -> Storage:
    """A backend for a store URL: a plain path or ``file://`` is local, ``s3://`` is S3Storage, anything else fsspec.

    An S3 store's options also come from ``SHARDSTORE_STORAGE_OPTIONS`` and the URL's query
    (``backends.options``); a local store takes none."""
    if "://" not in url:
        return LocalStorage(url)
    if url.startswith("file://"):
        return LocalStorage(url[len("file://") :])
    if url.startswith(("s3://", "s3a://")):
        try:
            from .s3.storage import S3Storage  # conditional writes need the raw client, not fsspec's surface
        except ImportError as e:
            raise StorageError(f"cannot open store {url!r}: S3 support needs s3fs ({e})") from None
        url, options = resolve(url, dict(storage_options))
        check_s3_options(url, options)
        return S3Storage(url, **options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except (
        ValueError,
        ImportError,
        TypeError,
        OSError,
    ) as e:  # unknown protocol, its package not installed, bad options
        raise StorageError(f"cannot open store {url!r}: {e}") from None
    if url.startswith("memory://"):
        root = "/" + root.lstrip("/")
    return FsspecStorage(fs, root, url)
