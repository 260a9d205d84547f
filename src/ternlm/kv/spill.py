"""Background writes from the RAM tier to the disk tier (and, with a second Spiller, of published
blocks to the Redis tier: any sink with `put(block) -> bool` that never raises for I/O trouble).

Why a thread: writing one smollm2 block (11.8 MB, hashed, fsynced) takes ~30 ms here, and a slot
reset can push a dozen blocks out of a full RAM tier. Done on the engine's worker thread that would
stall every running stream for a second. So blocks leaving RAM wait in `pending` (still findable
and loadable, like RAM blocks) while one writer thread puts them on disk, oldest first.
Memory stays bounded: past `max_pending_bytes` a non-blocking submit drops the block (it is a
cache; the next request recomputes it) and counts it.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from typing import Protocol

from .blockfile import BlockKV

log = logging.getLogger("ternlm.cache")


class Sink(Protocol):
    def put(self, block: BlockKV) -> bool: ...


class Spiller:
    """Thread-safe. `submit`/`get`/`flush` from any thread; one daemon writer thread does sink.put."""

    def __init__(self, sink: Sink, max_pending_bytes: int = 512 << 20, name: str = "ternlm-kv-spill"):
        self.sink = sink
        self.max_pending_bytes = max_pending_bytes
        self.dropped = 0                      # blocks not written because the queue was full
        self._pending: OrderedDict[bytes, BlockKV] = OrderedDict()   # waiting or being written
        self._bytes = 0
        self._busy = 0                        # blocks taken by the writer, not yet finished
        self._closing = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __contains__(self, key: bytes) -> bool:
        with self._cv:
            return key in self._pending

    def get(self, key: bytes) -> BlockKV | None:
        """A block (by name, BlockMeta.name) still waiting for (or in) its disk write; None if it is
        not pending."""
        with self._cv:
            return self._pending.get(key)

    def tails(self, locator: bytes) -> list[BlockKV]:
        """Tail entries following one parent that still wait for (or are in) their disk write."""
        with self._cv:
            return [b for name, b in self._pending.items() if len(name) == 64 and name[:32] == locator]

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def submit(self, block: BlockKV, wait: bool = False) -> bool:
        """Queue a block for the disk. Without `wait`, a full queue drops it (returns False);
        with `wait`, blocks until there is room (used at shutdown)."""
        key = block.meta.name
        with self._cv:
            if self._closing:
                self.dropped += 1
                return False
            if key in self._pending:
                return True
            while self._bytes + block.nbytes > self.max_pending_bytes and self._pending:
                if not wait:
                    self.dropped += 1
                    return False
                self._cv.wait()
            self._pending[key] = block
            self._bytes += block.nbytes
            self._cv.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted block has been written (or failed). Returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is pending, then end the writer thread. Returns False if it did not end in time.
        Later submits are dropped."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: len(self._pending) > self._busy or self._closing)
                if not self._pending:
                    return                  # closing, and everything is written
                key, block = next(iter(self._pending.items()))
                self._busy = 1
            try:
                self.sink.put(block)        # never raises for I/O trouble; logs it
            except Exception:               # a bug: log, drop the block, keep the writer alive
                log.exception("KV cache: writing a block failed (%s)", self._thread.name)
            with self._cv:
                self._pending.pop(key, None)
                self._bytes -= block.nbytes
                self._busy = 0
                self._cv.notify_all()
