"""What a drafter learns and keeps in a file (the n-gram lookup's learned cache, the suffix
drafter's history): whether it changed since it was loaded or saved, the periodic save, and a
failed save kept for the owner, who reports it once as a fault (never a request's error).

>>> import tempfile, os
>>> path, written = os.path.join(tempfile.mkdtemp(), "f.bin"), []
>>> def write():
...     written.append(1)
...     open(path, "wb").close()
>>> state = SavedState(path, 0.0, write, "the file")
>>> state.learned(); state.close(); state.close(); written
[1]
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from ..errors import CacheFormatError


class SavedState:
    """One drafter's learned file. ``path`` '' = nothing is saved; ``save_period`` seconds between
    periodic saves (0 = only at close); ``write`` writes the file (atomically, only over a file of
    ours: its own errors say why not); ``what`` names it in a fault ("the suffix history").

    Drafters for other requests at the same time (``for_slot``) share their owner's SavedState:
    what they learn marks it changed, and only the owner saves and closes it."""

    def __init__(self, path: str, save_period: float, write: Callable[[], None], what: str) -> None:
        self.path = path
        self.save_period = save_period
        self._write = write
        self.what = what
        self.changed = False
        #: a periodic save's failure not yet taken by the owner (who reports it as a fault)
        self.error: Optional[str] = None
        self._last_save = time.monotonic()

    def learned(self) -> None:
        """What the file holds changed (a request ended with something to keep)."""
        self.changed = True

    def save(self) -> None:
        """Write the file now if there is one (its errors raised)."""
        self._last_save = time.monotonic()
        if self.path:
            self._write()
            self.changed = False

    def save_if_due(self) -> None:
        """Save if it changed and the save period has passed; a failure (a full disk, a removed
        folder, a count that does not fit the file) is kept for :meth:`take_fault`, never raised."""
        period = self.save_period
        if period and self.changed and time.monotonic() - self._last_save >= period:
            try:
                self.save()
            except (OSError, CacheFormatError, ValueError) as error:
                self.error = f"saving {self.what} failed: {error}"

    def take_fault(self) -> Optional[str]:
        """A periodic save's failure since the last call (reported once), else None."""
        fault, self.error = self.error, None
        return fault

    def close(self) -> None:
        """Save if it changed since it was loaded or saved, or if its file does not exist yet (a
        large file is not rewritten for nothing). Safe to call more than once."""
        if self.path and (self.changed or not Path(self.path).exists()):
            self.save()


__all__ = ["SavedState"]
