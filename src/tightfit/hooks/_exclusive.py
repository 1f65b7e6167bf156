"""One forward at a time per hook. Private.

tightfit's hooks swap tensors on their module for the length of a forward and put the
stored ones back afterwards; a second thread entering the same module meanwhile would
save the first thread's copies as "stored" and leave them behind. The second thread gets
a clear error instead; the first one goes on undisturbed. The same thread may re-enter
(a module that runs inside itself). Skipped while ``torch.compile`` traces the hook.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

__all__: list[str] = []


class OneForwardAtATime:
    """A non-blocking, re-entrant claim on one hook: taken in ``pre_forward``, given back after."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self._lock = threading.RLock()

    def enter(self, module: nn.Module) -> None:
        if torch.compiler.is_compiling():
            return
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"this {type(module).__name__} is running a forward in another thread ({self.hook}): a module with "
                f"tightfit hooks runs one forward at a time. Call it from one thread at a time (a lock around the "
                f"call), or give each thread its own copy of the model"
            )

    def exit(self) -> None:
        if torch.compiler.is_compiling():
            return
        try:
            self._lock.release()
        except RuntimeError:  # entered while torch.compile traced it: nothing was taken
            pass
