"""Progress of a download, measured on disk: bytes under the ``.partial`` directory every few
seconds, logged as done / total, rate and ETA. Measuring the directory works the same for every hub
client (each writes its temporary files inside the target), without hooking their progress bars."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path


class Progress:
    def __init__(self, directory: Path, total: int, log: logging.Logger, interval: float = 10.0) -> None:
        self.directory, self.total, self.log, self.interval = directory, total, log, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prewarm-progress", daemon=True)
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        elapsed = time.monotonic() - self._started
        done = self.bytes_on_disk()
        self.log.info(self.line(done, done / max(elapsed, 1e-6)))

    def bytes_on_disk(self) -> int:
        total = 0
        for root, _dirs, files in os.walk(self.directory):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass  # renamed or removed between listing and stat
        return total

    def _run(self) -> None:
        last_bytes, last_time = 0, self._started
        while not self._stop.wait(self.interval):
            now, done = time.monotonic(), self.bytes_on_disk()
            rate = max(done - last_bytes, 0) / max(now - last_time, 1e-6)
            last_bytes, last_time = done, now
            self.log.info(self.line(done, rate))

    def line(self, done: int, rate: float) -> str:
        pct = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        left = self.total - done
        # Not from the first trickle: an ETA of hours while a connection opens says nothing.
        eta = f", ETA {self.duration(left / rate)}" if rate > 0 and left > 0 and done * 100 >= self.total else ""
        return f"downloaded {self.human(done)} of {self.human(self.total)}{pct}, {self.human(rate)}/s{eta}"

    @staticmethod
    def human(n: float) -> str:
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or unit == "TiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024
        return f"{n:.1f} TiB"

    @staticmethod
    def duration(seconds: float) -> str:
        seconds = int(seconds)
        if seconds >= 3600:
            return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 60:
            return f"{seconds // 60}m{seconds % 60:02d}s"
        return f"{seconds}s"
