"""The garbage collector and a server's long-lived heap.

A full collection walks every container the process holds: over a server's startup heap
(its modules, its settings, a loaded model's vocabulary and metadata) one held the event
loop for 40 to 90 ms, whatever request was waiting. What lives on once a server is up is
moved out of the collector's reach (`gc.freeze`): the collections then walk only what
requests add.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect what is garbage now, then freeze the rest (objects frozen are never
    collected: call it when what the process holds is what it keeps, after startup or a
    model's load, not with requests in flight)."""
    gc.collect()
    gc.freeze()
