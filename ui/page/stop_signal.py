"""A running job's stop, readable wherever its model work runs.

On ZeroGPU the model work runs in a GPU worker, a process forked from this one, which cannot see
this process's `threading.Event`s; the only thing `spaces` carries back is closing the generator,
which loses the run's final result (a stopped Compare run's answers so far). So a running job's
stop, and the columns stopped on their own, are kept in a small table of shared memory, made when
this module loads: every process forked afterwards (the worker is forked at a GPU call) shares it.
A `StopSignal` pickles as its serial number, so the work's copy in the worker reads the same cells.
Outside ZeroGPU the work runs in this process and reads them the same way.
"""

from __future__ import annotations

import itertools
import mmap
import threading

SLOTS = 64  # running jobs at once (the model line runs one); a slot is reused 64 jobs later
_SERIAL, _STOPPED, _ROWS = range(3)  # each slot: the job's serial, its stop (0/1), its rows stopped (bits)
_FIELDS = 3
MAX_ROW_BITS = 62  # rows a mask holds (a signed 64-bit cell)

# Anonymous and shared (MAP_SHARED is mmap's default): a forked process writes and reads the same pages.
_memory = mmap.mmap(-1, SLOTS * _FIELDS * 8)
_cells = memoryview(_memory).cast("q")
_serials = itertools.count(1)
_lock = threading.Lock()  # this process's writers (the read-modify-write of a row mask); the GPU
# worker only reads (a lock held here when it was forked would stay held there)


def claim() -> StopSignal:
    """A new, unset signal for a job about to run."""
    with _lock:
        serial = next(_serials)
        base = (serial % SLOTS) * _FIELDS
        _cells[base + _STOPPED] = 0
        _cells[base + _ROWS] = 0
        _cells[base + _SERIAL] = serial  # last: the slot is this job's once its cells are clear
    return StopSignal(serial)


class StopSignal:
    """A job's stop as the model work sees it: `is_set()` / `set()` like a `threading.Event`, and
    the rows (engine row indices) stopped on their own. A slot taken over by a later job reads as
    set: the job it belonged to ended long ago."""

    def __init__(self, serial: int):
        self.serial = serial
        self._base = (serial % SLOTS) * _FIELDS

    def __reduce__(self):
        return StopSignal, (self.serial,)

    def _mine(self) -> bool:
        return _cells[self._base + _SERIAL] == self.serial

    def is_set(self) -> bool:
        return not self._mine() or _cells[self._base + _STOPPED] == 1

    def set(self) -> None:
        with _lock:
            if self._mine():
                _cells[self._base + _STOPPED] = 1

    def stop_row(self, index: int) -> None:
        if not 0 <= index <= MAX_ROW_BITS:
            raise ValueError(f"row {index} is outside the signal's {MAX_ROW_BITS + 1} rows")
        with _lock:
            if self._mine():
                _cells[self._base + _ROWS] |= 1 << index

    def rows(self) -> set[int]:
        """The rows asked to stop on their own so far."""
        mask = _cells[self._base + _ROWS] if self._mine() else 0
        return {i for i in range(MAX_ROW_BITS + 1) if mask >> i & 1}


class JobStop(threading.Event):
    """A page job's stop (Stop, a cancelled request, a page gone): an event in this process, and,
    once the job runs, also its `StopSignal` (what its model work reads)."""

    signal: StopSignal | None = None

    def attach(self, signal: StopSignal) -> None:
        self.signal = signal
        if self.is_set():  # stopped before it started
            signal.set()

    def set(self) -> None:
        super().set()
        if self.signal is not None:
            self.signal.set()
