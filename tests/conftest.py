"""Shared fixtures: stores on every local backend, and small models with real AdamW state."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: same kernels in tests and their workers

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Default memory tiers (shardtrain.run.tiers) go under a directory of this session, not /dev/shm:
# set before the forkserver below starts, so every worker the suite forks inherits it.
_TIER_ROOT = tempfile.mkdtemp(prefix="shardstore-test-tiers-")
os.environ.setdefault("SHARDSTORE_TIER_ROOT", _TIER_ROOT)
atexit.register(shutil.rmtree, _TIER_ROOT, True)

import pytest  # noqa: E402
import torch  # noqa: E402

import shardstore as ss  # noqa: E402
from shardtrain.run.lifecycle import DETERMINISTIC_ENV  # noqa: E402
from shardtrain.workers import forkserver  # noqa: E402

# One server that imported torch forks every local worker of the suite (the launcher's and
# the tests' own groups) instead of each spawned process importing torch again: seconds per
# group on 2 cores. Started now, with the variables the trainer's launches use, so that
# they all share it (shardtrain/workers/forkserver.py says when a launch falls back to spawn).
START_METHOD = "forkserver" if forkserver.start(DETERMINISTIC_ENV) else "spawn"


#: The import-time variables (forkserver.IMPORT_TIME_PREFIXES) the server above started with.
_SERVER_VARIABLES = {k: v for k, v in os.environ.items() if k.startswith(forkserver.IMPORT_TIME_PREFIXES)}


def _reset_import_time_variables() -> None:
    for k in [k for k in os.environ if k.startswith(forkserver.IMPORT_TIME_PREFIXES)]:
        if k not in _SERVER_VARIABLES:
            del os.environ[k]
    os.environ.update(_SERVER_VARIABLES)


@pytest.fixture(autouse=True)
def _import_time_variables_as_the_server_has_them() -> object:
    """Each test starts and ends with the import-time variables the suite's server started with.

    The frameworks the adapters are tested against write the process environment: importing
    lightning's fabric (at collection, by the module that imports it) sets
    `PYTORCH_NVML_BASED_CUDA_CHECK`, torchtitan's determinism helper sets `PYTHONHASHSEED` and
    NCCL variables. To the launcher those are import-time variables a worker forked from the
    server could not see, so every later launch of the session fell back to spawning fresh
    interpreters: measured, the regroup/grow fixture took 40 s after the adapter tests against
    12 s alone, and the whole command about two minutes more. A test that sets such a variable
    on purpose (monkeypatch) still sees it: this runs before the test's own fixtures and after
    their teardown.
    """
    _reset_import_time_variables()
    yield
    _reset_import_time_variables()


@pytest.fixture
def store(tmp_path) -> ss.Store:
    """A fresh local store in a temporary directory."""
    return ss.open_store(str(tmp_path / "store"))


@pytest.fixture(params=["local", "memory"])
def any_store(request, tmp_path) -> ss.Store:
    """A fresh store on each backend available without a server."""
    if request.param == "local":
        return ss.open_store(str(tmp_path / "store"))
    return ss.open_store(f"memory://shardstore-tests/{uuid.uuid4().hex}")


class TensorHolder:
    """An extra (``state_dict()`` / ``load_state_dict()``) whose state is one tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]


class TinyNet(torch.nn.Module):
    """A few layers with 1-D and 2-D parameters, enough for two optimizer groups."""

    def __init__(self, seed: int = 0, width: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = torch.nn.Linear(4, width)
        self.norm = torch.nn.LayerNorm(width)
        self.mid = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.norm(self.inp(x)))))


def make_optimizer(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ],
        lr=lr,
    )


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=g)
        y = torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.fixture
def trained():
    """A TinyNet and its AdamW after three steps."""
    model = TinyNet()
    opt = make_optimizer(model)
    train_steps(model, opt, 3)
    return model, opt


from adaptive_fixtures import adaptive_run  # noqa: E402,F401  (session-scoped: shared by test_regroup and test_grow)
