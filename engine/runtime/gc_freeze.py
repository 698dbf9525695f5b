"""Keep Python's full garbage collections short once the engine has started.

A full (generation 2) collection walks every tracked object: after start-up that is the
imported libraries (torch, transformers, Triton: ~330k objects) plus the engine's own, and it
stopped the step loop for 250-400 ms each time it ran. The overlapped scheduler keeps only
one step queued on the GPU (20-140 ms in W1), so each such pause left the GPU idle: 1.2-1.3 s
of W1's ~21 s on the H200 went to gaps before decode steps of up to 406 ms.

`freeze_after_start` collects once and moves every object alive at the end of start-up into
the permanent generation (`gc.freeze()`), which later collections skip; what remains for
them is what serving allocates (requests and their token lists; the radix tree keeps its
tokens in tuples, which leave the collector's view): on a 2-core box a full collection in
W1's host loop fell from 240-270 ms to 35-60 ms, and to 20-34 ms with the tuples.

The OpenAI ingress replicas freeze too (deployments/ingress.py): every stream through one
waits out its collections, ~300 ms over the libraries and the tokenizer it has loaded; so does
an engine replica whose engine runs in a child process (it forwards every delta).

Frozen objects are still freed by reference counting, but a frozen reference cycle that
later becomes garbage is never collected: an engine's weights sit in such cycles. So the
objects are unfrozen again when the owner (the `Engine`, a tensor-parallel rank's runner)
is freed, and the next collection reclaims them: a process may build and drop engines.
"""
from __future__ import annotations

import gc
import os
import weakref


def freeze_after_start(owner: object, enabled: bool = True) -> None:
    """Freeze what is alive now; unfreeze when `owner` is freed. RADIXSERVE_GC_FREEZE=0
    turns it off (the test suite builds hundreds of engines: each start's collection
    costs ~0.2 s on a 2-core box)."""
    if not enabled or os.environ.get("RADIXSERVE_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()
    weakref.finalize(owner, gc.unfreeze)
