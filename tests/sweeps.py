"""How densely a fault sweep runs, in three tiers.

- ``sample``: the README's test command (within its 8 minutes on 2 cores) runs a sparse,
  evenly spread sample of the sweep's points, so every kind of point is still hit;
- ``dense``: ``.ci/run``'s second step (``-m "e2e or long"``) runs the sweep at the density
  CI has always run it at;
- ``SHARDSTORE_SLOW=1``: every point (hours for some sweeps; by hand).

A test takes the ``density`` parameter (``DENSITIES``) and asks ``stride(density, dense=...)``
for its step through the sweep's points.
"""

from __future__ import annotations

import os

import pytest

SLOW = bool(os.environ.get("SHARDSTORE_SLOW"))

#: The two tiers a sweep runs in: ``sample`` in the test command, ``dense`` in CI's long step.
DENSITIES = [pytest.param("sample", id="sample"), pytest.param("dense", id="dense", marks=pytest.mark.long)]


def stride(density: str, *, dense: int, sample_factor: int = 3) -> int:
    """The step through a sweep's points: 1 under SHARDSTORE_SLOW, ``dense`` in CI's long step,
    ``dense * sample_factor`` in the test command's sample."""
    if SLOW:
        return 1
    return dense if density == "dense" else dense * sample_factor
