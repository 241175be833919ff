"""``shardstore.manifest``: manifest schemas and their canonical encoding, where the README has always pointed.

A thin re-export of ``shardstore.format.manifest``, kept for code that imports it by this name;
shardstore itself imports the real module.
"""

from .format.manifest import *  # noqa: F401,F403
from .format.manifest import __all__  # noqa: F401
