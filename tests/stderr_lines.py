"""The stderr of a process started by a test, line by line, read by a thread that is joined before
the pipe is closed (closing it under a reader still iterating raises in that thread)."""

from __future__ import annotations

import queue
import subprocess
import threading


class StderrLines:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None, "start the process with stderr=subprocess.PIPE, text=True"
        self._proc = proc
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stderr:  # type: ignore[union-attr]
            self._lines.put(line)

    def get(self, timeout: float) -> str:
        """The next line; queue.Empty when none came within ``timeout``."""
        return self._lines.get(timeout=timeout)

    def close(self) -> None:
        """After the process has exited: let the reader reach the end of the pipe, then close it."""
        self._reader.join(10)
        self._proc.stderr.close()  # type: ignore[union-attr]
