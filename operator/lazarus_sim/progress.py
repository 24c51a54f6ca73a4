"""A one-line progress bar on stderr for runs that take more than a moment."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30):
        self.total, self.label, self.width = total, label, width
        self.done = 0
        self.enabled = enabled and total > 1

    def tick(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                         f"{self.done}/{self.total}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
