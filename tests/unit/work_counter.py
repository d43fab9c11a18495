"""Counts the Python work a piece of code does, for tests that show a cost does not grow with a size.

Counted rather than timed, so a busy machine cannot fail such a test: lines run (`sys.settrace`) and
functions called, Python and C (`sys.setprofile`). A loop over a pool's blocks in Python, or a call
made once per block, shows in these counts; a single C call that walks a container does not.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    lines: int
    calls: int

    def about(self, other: Work) -> bool:
        """Within 10 % of `other`: timed branches (a latency histogram's bucket search, for one)
        move the counts by a few dozen from run to run; work per block adds thousands."""
        return (
            abs(self.lines - other.lines) <= other.lines / 10
            and abs(self.calls - other.calls) <= other.calls / 10
        )


def count_work(run: Callable[[], object]) -> Work:
    lines = calls = 0

    def count_lines(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count_lines

    def count_calls(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    tracer, profiler, collecting = sys.gettrace(), sys.getprofile(), gc.isenabled()
    gc.collect()  # finalizers of earlier garbage, run by a collection, are not `run`'s work
    gc.disable()
    sys.settrace(count_lines)
    sys.setprofile(count_calls)
    try:
        run()
    finally:
        sys.setprofile(profiler)
        sys.settrace(tracer)  # a coverage tracer or debugger goes on as before
        if collecting:
            gc.enable()
    return Work(lines, calls)
