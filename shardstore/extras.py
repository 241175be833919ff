"""``shardstore.extras``: extras' state documents, where the README has always pointed.

A thin re-export of ``shardstore.state.extras``, kept for code that imports it by this name;
shardstore itself imports the real module.
"""

from .state.extras import *  # noqa: F401,F403
from .state.extras import __all__  # noqa: F401
