"""Per-Pod counters of one gateway Pod's workers, in shared memory, for ``/metrics``.

Each worker balances over the backend Pods itself (gateway.backends) and writes its own table: up
to ``SLOTS`` Pods, each a name and two counters (requests outstanding, requests sent). A scrape,
served by any worker, sums every worker's table by Pod name. Writers never lock (one writer per
table); a slot is cleared when its Pod leaves the EndpointSlices, so the ``pod`` label stays
bounded by the replicas that exist (a Pod beyond ``SLOTS`` counts under ``pod="other"``).
"""

from __future__ import annotations

import mmap

__all__ = ["PodTable", "PodTableRow", "SLOTS", "OTHER"]

SLOTS = 64
NAME_BYTES = 128  # a Pod name is at most 253 characters; ReplicaSet Pods' names are far shorter
OTHER = "other"
_OUTSTANDING, _SERVED = 0, 1


class PodTable:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._names = mmap.mmap(-1, workers * SLOTS * NAME_BYTES)
        self._cells = memoryview(mmap.mmap(-1, workers * (SLOTS + 1) * 2 * 8)).cast("d")

    def clear(self, worker: int) -> None:
        """A worker died: its table goes (its requests in flight went with it; the restarted worker
        starts a table of its own, and Prometheus reads the drop of its counters as a reset)."""
        self._names[worker * SLOTS * NAME_BYTES:(worker + 1) * SLOTS * NAME_BYTES] = b"\0" * (SLOTS * NAME_BYTES)
        start = self.cell(worker, 0, 0)
        self._cells[start:start + (SLOTS + 1) * 2] = memoryview(bytes(8 * (SLOTS + 1) * 2)).cast("d")

    def row(self, worker: int) -> PodTableRow:
        return PodTableRow(self, worker)

    def name_at(self, worker: int, slot: int) -> str:
        at = (worker * SLOTS + slot) * NAME_BYTES
        raw = self._names[at:at + NAME_BYTES]
        return raw.rstrip(b"\0").decode("utf-8", "replace")

    def cell(self, worker: int, slot: int, which: int) -> int:
        """Index of a counter (slot ``SLOTS`` is the row's ``other``)."""
        return (worker * (SLOTS + 1) + slot) * 2 + which

    def totals(self) -> dict[str, tuple[float, float]]:
        """Pod name -> (outstanding, sent), summed over the workers."""
        out: dict[str, list[float]] = {}
        cells = self._cells
        for worker in range(self.workers):
            for slot in range(SLOTS + 1):
                name = OTHER if slot == SLOTS else self.name_at(worker, slot)
                if not name:
                    continue
                outstanding = cells[self.cell(worker, slot, _OUTSTANDING)]
                sent = cells[self.cell(worker, slot, _SERVED)]
                if slot == SLOTS and not (outstanding or sent):
                    continue
                total = out.setdefault(name, [0.0, 0.0])
                total[0] += outstanding
                total[1] += sent
        return {name: (v[0], v[1]) for name, v in out.items()}


class PodTableRow:
    """One worker's table (only that worker writes it)."""

    def __init__(self, table: PodTable, worker: int) -> None:
        self.table = table
        self.worker = worker
        self._slots: dict[str, int] = {}
        self._free = list(range(SLOTS - 1, -1, -1))

    def slot(self, name: str) -> int:
        """The Pod's slot, assigned on first use (``SLOTS``, the row's ``other``, when full)."""
        slot = self._slots.get(name)
        if slot is not None:
            return slot
        if not self._free:
            return SLOTS
        slot = self._free.pop()
        table = self.table
        at = (self.worker * SLOTS + slot) * NAME_BYTES
        encoded = name.encode()[:NAME_BYTES]
        table._cells[table.cell(self.worker, slot, _OUTSTANDING)] = 0.0
        table._cells[table.cell(self.worker, slot, _SERVED)] = 0.0
        table._names[at:at + NAME_BYTES] = encoded.ljust(NAME_BYTES, b"\0")
        self._slots[name] = slot
        return slot

    @property
    def cells(self) -> memoryview:
        """The counters: a slot's are ``cells[counter(slot)]`` (outstanding) and the one after (sent)."""
        return self.table._cells

    def counter(self, slot: int) -> int:
        return self.table.cell(self.worker, slot, _OUTSTANDING)

    def sent(self, slot: int) -> None:
        table = self.table
        table._cells[table.cell(self.worker, slot, _OUTSTANDING)] += 1
        table._cells[table.cell(self.worker, slot, _SERVED)] += 1

    def finished(self, slot: int) -> None:
        table = self.table
        table._cells[table.cell(self.worker, slot, _OUTSTANDING)] -= 1

    def free(self, name: str) -> None:
        """The Pod left: its slot (name and counters) is cleared for another."""
        slot = self._slots.pop(name, None)
        if slot is None:
            return
        table = self.table
        at = (self.worker * SLOTS + slot) * NAME_BYTES
        table._names[at:at + NAME_BYTES] = b"\0" * NAME_BYTES
        table._cells[table.cell(self.worker, slot, _OUTSTANDING)] = 0.0
        table._cells[table.cell(self.worker, slot, _SERVED)] = 0.0
        self._free.append(slot)
