"""Where a store's storage options come from (README "Storage options"), in one place.

A backend gets keyword options (for S3: ``endpoint_url``, ``key``/``secret``/``token``,
``profile``, ``client_kwargs``, ``config_kwargs``, ``part_size``, ``concurrency``...; the
``S3Storage`` docstring lists them). They are merged from, weakest first:

1. ``SHARDSTORE_STORAGE_OPTIONS``, a JSON object in the environment (inherited by every
   worker a launcher starts, so a whole job sees the same options);
2. the store URL's query, for the few options that name where the store is:
   ``s3://bucket/prefix?endpoint_url=http://10.0.0.9:9000&region_name=us-east-1``
   (``region_name`` goes to ``client_kwargs``); any other query key is refused, naming
   the option to use instead;
3. the caller's keywords: ``open_store(url, **options)``, which the command lines fill
   from ``--storage-option KEY=VALUE`` (repeatable; VALUE is JSON when it parses as JSON,
   else a string; ``a.b=v`` sets key ``b`` inside option ``a``).

Credentials stay where botocore looks for them (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``, instance roles) unless an option names them.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import parse_qsl

from ..errors import StorageError

__all__ = ["ENV", "URL_OPTIONS", "parse_option", "merge", "resolve", "check_s3_options", "environment_with"]

ENV = "SHARDSTORE_STORAGE_OPTIONS"
#: Query keys a store URL may carry (where the store is), and the option each sets.
_STRINGS = frozenset({"endpoint_url", "key", "secret", "token", "profile", "region_name", "username", "password"})
URL_OPTIONS = {
    "endpoint_url": ("endpoint_url",),
    "region_name": ("client_kwargs", "region_name"),
    "profile": ("profile",),
}


def parse_option(text: str) -> tuple[tuple[str, ...], Any]:
    """``KEY=VALUE`` as (key path, value): ``client_kwargs.region_name=eu-west-1`` gives
    (("client_kwargs", "region_name"), "eu-west-1"); ``concurrency=8`` gives an int."""
    key, sep, raw = text.partition("=")
    path = tuple(key.strip().split("."))
    if not sep or not all(p.isidentifier() for p in path):
        raise ValueError(f"expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000), got {text!r}")
    if path[-1] in _STRINGS:  # a numeric-looking access key or secret stays a string
        return path, raw
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return path, value


def environment_with(texts: list[str]) -> str:
    """The value of ``SHARDSTORE_STORAGE_OPTIONS`` with the ``KEY=VALUE`` options ``texts``
    merged over what it holds now (the command lines set it, so that every store the process
    and the workers it starts open gets the options)."""
    options = _from_env()
    for text in texts:
        options = merge(options, *parse_option(text))
    return json.dumps(options, sort_keys=True)


def merge(options: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``options`` with ``value`` set at ``path`` (nested dictionaries merged, not replaced)."""
    out = dict(options)
    if len(path) == 1:
        if isinstance(value, dict) and isinstance(out.get(path[0]), dict):
            value = {**out[path[0]], **value}
        out[path[0]] = value
        return out
    inner = out.get(path[0])
    if inner is not None and not isinstance(inner, dict):
        raise StorageError(f"storage option {path[0]!r} is {inner!r}, not an object: cannot set {'.'.join(path)}")
    out[path[0]] = merge(dict(inner or {}), path[1:], value)
    return out


def _from_env() -> dict[str, Any]:
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise StorageError(f"{ENV} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise StorageError(f"{ENV} must be a JSON object of storage options, got {type(value).__name__}")
    return value


def resolve(url: str, explicit: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the URL without its query, the merged options) for a store URL (see module docstring)."""
    options = _from_env()
    base, sep, query = url.partition("?")
    if sep and "://" in base:
        for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
            if key not in URL_OPTIONS:
                raise StorageError(
                    f"store URL {url!r}: {key!r} cannot be given in the URL (only {', '.join(URL_OPTIONS)} can); "
                    f"pass it as --storage-option {key}=VALUE, open_store(url, {key}=...) or in {ENV}"
                )
            options = merge(options, URL_OPTIONS[key], value)
        url = base
    for key, value in explicit.items():
        options = merge(options, (key,), value)
    return url, options


#: Options s3fs takes through ``**kwargs`` (not in its signature) that a store may need.
_S3FS_EXTRA = frozenset({"profile", "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def check_s3_options(url: str, options: dict[str, Any]) -> None:
    """StorageError naming any option neither ``S3Storage`` nor s3fs takes (s3fs would
    silently keep an unknown one, so a misspelt ``endpoint_url`` would reach AWS instead)."""
    import inspect

    import s3fs

    from .s3.storage import S3Storage

    known = set(_S3FS_EXTRA)
    for fn in (S3Storage.__init__, s3fs.S3FileSystem.__init__):
        known |= {
            n
            for n, p in inspect.signature(fn).parameters.items()
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
        }
    known -= {"self", "url", "loop", "asynchronous"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise StorageError(
            f"cannot open store {url!r}: unknown storage option(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
