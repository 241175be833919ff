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

Before a backend is made, the merged options are checked (``check_s3_options``): every name
is one ``S3Storage`` or s3fs takes, the options whose type is known have it (``part_size``
an integer, ``client_kwargs`` an object...), ``endpoint_url`` is a URL botocore accepts, and
``key`` and ``secret`` come together. Anything else is a ``StorageOptionError`` naming the
option, never a traceback from the first request.

Credentials stay where botocore looks for them (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``, instance roles) unless an option names them.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import parse_qsl

import msgspec

from ..errors import StorageOptionError

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
        raise StorageOptionError(f"storage option {path[0]!r} is {inner!r}, not an object: cannot set {'.'.join(path)}")
    out[path[0]] = merge(dict(inner or {}), path[1:], value)
    return out


def _from_env() -> dict[str, Any]:
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise StorageOptionError(f"{ENV} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise StorageOptionError(f"{ENV} must be a JSON object of storage options, got {type(value).__name__}")
    return value


def resolve(url: str, explicit: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the URL without its query, the merged options) for a store URL (see module docstring)."""
    options = _from_env()
    base, sep, query = url.partition("?")
    if sep and "://" in base:
        for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
            if key not in URL_OPTIONS:
                raise StorageOptionError(
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


class _Typed(msgspec.Struct):
    """The options whose type is known (``S3Storage``'s and s3fs's), as JSON gives them;
    a wrong one would fail only at the first request, deep in botocore. Others pass as given."""

    conditional: bool | None = None
    part_size: int = 0
    multipart_threshold: int | None = None
    concurrency: int = 0
    attempts: int = 0
    backoff: float = 0.0
    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    profile: str | None = None
    username: str | None = None
    password: str | None = None
    anon: bool = False
    use_ssl: bool = True
    requester_pays: bool = False
    version_aware: bool = False
    default_block_size: int | None = None
    max_concurrency: int = 1
    client_kwargs: dict[str, Any] | None = None
    config_kwargs: dict[str, Any] | None = None
    s3_additional_kwargs: dict[str, Any] | None = None


_WHERE = f"(from --storage-option, {ENV}, the store URL or open_store's keywords)"


def check_s3_options(url: str, options: dict[str, Any]) -> None:
    """StorageOptionError naming any option neither ``S3Storage`` nor s3fs takes (s3fs would
    silently keep an unknown one, so a misspelt ``endpoint_url`` would reach AWS instead), one
    of the wrong type, an ``endpoint_url`` botocore would refuse, or a key without its secret."""
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
        raise StorageOptionError(
            f"cannot open store {url!r}: unknown storage option(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    try:
        typed = msgspec.convert(options, _Typed)
    except msgspec.ValidationError as e:  # "Expected `int`, got `str` - at `$.part_size`"
        m = re.fullmatch(r"(.*) - at `\$\.?(.*)`", str(e))
        what, name = (m[1], m[2]) if m else (str(e), "?")
        raise StorageOptionError(f"cannot open store {url!r}: storage option {name}: {what} {_WHERE}") from None
    if (typed.key is None) != (typed.secret is None):
        given, missing = ("key", "secret") if typed.secret is None else ("secret", "key")
        raise StorageOptionError(
            f"cannot open store {url!r}: storage option {given} is given without {missing} {_WHERE}; "
            "give both, or neither to use the credentials botocore finds (AWS_ACCESS_KEY_ID, a profile, a role)"
        )
    if typed.endpoint_url is not None:
        from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

        if not (is_valid_endpoint_url(typed.endpoint_url) or is_valid_ipv6_endpoint_url(typed.endpoint_url)):
            raise StorageOptionError(
                f"cannot open store {url!r}: storage option endpoint_url {typed.endpoint_url!r} is not a URL "
                f"with a scheme and a host (e.g. http://127.0.0.1:9000) {_WHERE}"
            )
