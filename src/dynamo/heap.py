"""Garbage-collector settings for a serving process, applied once it is ready.

Why: a server allocates a few small containers per token (chunk dicts, futures), and the cyclic
collector's full passes walk every tracked object, the ~45,000 made at start-up (modules, classes,
functions, templates) included.  Measured in the distributed benchmark (docs/performance.md), the
frontend spent 1.3 s of a 12 s run in full collections, up to 166 ms each: every stream stalls for
that long, the tokens pile up, and the next pass has even more to walk.  ``gc.freeze()`` moves
what exists when serving starts out of the collector's sight (it lives as long as the process
anyway), so a pass only walks what requests create.  And a young-generation pass every 10,000
net allocations instead of 700: with hundreds of streams in flight a pass mostly walks the young
objects still alive, about as many at either threshold, so far fewer passes cost far less (measured:
the frontend's collector time fell from 1.4 s to 0.25 s in a 15 s run, 38 young passes instead of
about 2,000).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

YOUNG_THRESHOLD = 10_000  # net allocations of tracked objects between young-generation passes


def settle_heap() -> None:
    """Collect start-up garbage once, then exclude everything still alive from later passes.

    Cheap when the CLI started us: :func:`startup_imports` has frozen what the imports made, so this pass
    walks only what came after (about 1,800 objects for ``in=http out=echo_full``: 0.3 to 0.5 ms).  It
    used to walk all of start-up's objects: 20 to 30 ms, freeing 5 of 38,555, just when the first request
    was waiting (docs/performance.md, "Start-up").
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, gen1, gen2)


@contextlib.contextmanager
def startup_imports() -> Iterator[None]:
    """No collector passes while start-up imports (the CLI's ``main``); what they made is frozen after.

    Why: importing the modules of ``in=http`` allocates about 40,000 tracked objects, nearly all of
    them alive for good (modules, classes, functions), and the collector's automatic passes over them
    took 14 to 30 ms of a 0.2 to 0.3 s start (77 passes; docs/performance.md, "Start-up").  Frozen
    afterwards (``gc.freeze``, as :func:`settle_heap` does once serving), they are not walked again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
