"""``shardstore.torch_optim``: the torch form of any optimizer, where the README has always pointed.

A thin re-export of ``shardstore.state.torch_optim``, kept for code that imports it by this name;
shardstore itself imports the real module.
"""

from .state.torch_optim import *  # noqa: F401,F403
from .state.torch_optim import __all__  # noqa: F401
