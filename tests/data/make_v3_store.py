"""How ``tests/data/v3_store.tar.gz`` was made (kept for provenance; it needs shardstore from
before format version 4, commit 3066e75 or earlier, whose writers used the row-band grid).

The state: ``legacy_state()`` in ``tests/shardstore/format/test_legacy_store.py`` (mostly zeros, so the archive
is small). Commit ``adam`` (version 2: chunked parameter and Adam moments) and its child
``sgd`` (version 3: a chunked torch-form ``momentum_buffer``), ref ``main`` on ``sgd``.

    .venv/bin/python tests/data/make_v3_store.py /tmp/v3store && \
        tar -C /tmp/v3store -czf tests/data/v3_store.tar.gz .
"""

from __future__ import annotations

import sys

import torch

import shardstore as ss

sys.path.insert(0, "tests/shardstore/format")
from test_legacy_store import LegacyModel  # noqa: E402


def main(path: str) -> None:
    store = ss.open_store(path, create=True)
    model = LegacyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.w.grad, model.b.grad = model.w.detach() / 4, torch.ones(5)
    opt.step()
    a = ss.save(store, model, opt, step=1, job="legacy", rng=False, ref="main")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.w.grad, model.b.grad = model.w.detach() / 8, torch.ones(5)
    sgd.step()
    b = ss.save(store, model, sgd, step=2, job="legacy", rng=False, ref="main")
    print(a, b)


if __name__ == "__main__":
    main(sys.argv[1])
