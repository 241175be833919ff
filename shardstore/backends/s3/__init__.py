"""The S3 backend: ``s3://bucket/prefix`` through s3fs's aiobotocore client (SPEC.md §19).

`storage` (`S3Storage`: the storage protocol over S3, refs and pins moved by conditional
requests) over `requests` (the probe of the server's request conditions, the concurrent
multipart upload), both over `transport` (`S3Transport`: one request, with bounded
concurrency and retries; the server's error answers, which failures are transient). Part of
`shardstore.backends`: imports only `backends.base`, `shardstore.format` and
`shardstore.errors` (s3fs and fsspec from outside, s3fs only when a store is opened).
"""
