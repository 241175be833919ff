"""Rendering a chat template within bounds: CPU time and output size.

A chat template is code that comes with a model (a Hugging Face directory, a job's bound
assets) and runs in jinja's sandbox, which keeps it from reaching Python's internals but
not from looping: jinja caps one ``range`` at 100,000 items, so two nested ones run 10^10
times and every command that renders the template (``prepare``, ``train``, ``evaluate``)
hangs. `bounded_render` runs one rendering under a budget of process CPU time, ended by
``SIGVTALRM`` (``setitimer(ITIMER_VIRTUAL)``): the signal's handler raises between two
bytecodes of the template's compiled Python, so any loop stops, and the rendering is
refused (`JobError`) once it has used ``RENDER_CPU_SECONDS``; its text is refused above
``MAX_RENDER_CHARS``. Real templates render a conversation in well under a millisecond.

A signal handler can only be set on the main thread: a rendering on another thread runs
without the time budget (none of shardtrain's does). One C-level operation (a string
repeated 10^10 times) is not interrupted; it is bounded by memory only.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from shardtrain.errors import JobError

__all__ = ["RENDER_CPU_SECONDS", "MAX_RENDER_CHARS", "bounded_render"]

#: CPU seconds one rendering of a chat template may take.
RENDER_CPU_SECONDS = 2.0
#: Characters one rendering may produce (a conversation longer than any context allows).
MAX_RENDER_CHARS = 64 << 20


class _Expired(BaseException):
    """The rendering used its CPU budget (a BaseException: template code catching Exception cannot swallow it)."""


@contextmanager
def _cpu_budget(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    armed = [True]

    def expired(signum: int, frame: FrameType | None) -> None:
        if armed[0]:  # a signal that arrives after the rendering returned is ignored
            raise _Expired

    previous = signal.signal(signal.SIGVTALRM, expired)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def bounded_render(render: Callable[[], str], what: str) -> str:
    """``render()``'s text, or JobError naming ``what`` (the template) if it runs past
    ``RENDER_CPU_SECONDS`` of CPU time or produces more than ``MAX_RENDER_CHARS``."""
    try:
        with _cpu_budget(RENDER_CPU_SECONDS):
            text = render()
    except _Expired:
        raise JobError(
            f"{what} did not finish rendering one conversation within {RENDER_CPU_SECONDS:g} s of CPU time "
            "(a template that loops without end, or nearly)"
        ) from None
    if len(text) > MAX_RENDER_CHARS:
        raise JobError(f"{what} rendered one conversation as {len(text)} characters, over {MAX_RENDER_CHARS}")
    return text
