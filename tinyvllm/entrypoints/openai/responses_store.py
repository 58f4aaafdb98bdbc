"""The store of the Responses API (``store: true``): stored responses, for ``GET`` / ``DELETE
/v1/responses/{id}`` and ``previous_response_id``.

One SQLite table (stdlib :mod:`sqlite3`) in a file under the cache directory
(``--responses-store-path``, default ``$TINYVLLM_CACHE/responses.sqlite``), so that a restarted server keeps its
conversations; ``:memory:`` keeps them in this process only (lost on restart). Memory use is that of SQLite's
page cache, whatever the number of rows: nothing is held in Python per response.

Bounds (all ``tinyvllm serve`` flags), enforced on every write:

* ``max_count`` rows and ``max_bytes`` bytes of stored payload: over either, the least recently used rows
  (by ``last_used``, updated by every read) are evicted (an LRU);
* ``ttl_s``: a row unused for longer is expired (deleted on the next write; never returned by a read).

A row carries ``owner``: a SHA-256 of the API key that stored it (``""`` when the server has no key); a read
or delete under another owner finds nothing, as if the id did not exist.

Thread-safe (one connection, one lock); the server calls it from a worker thread (a call takes well under a
millisecond: a write with ``synchronous=NORMAL`` in WAL mode needs no fsync, and the bounds are checked against
running totals, read once when the file is opened: one server per file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

logger = logging.getLogger("tinyvllm.responses")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    nbytes INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_last_used ON responses (last_used);
"""


def owner_of(api_key: str | None) -> str:
    """The owner tag of a request: hex SHA-256 of its API key, ``""`` for none (the key itself is never
    stored)."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest() if api_key else ""


class ResponseStore:
    """Stored responses, bounded by count, bytes and idle time (LRU eviction).

    Args:
        path: SQLite file (its directory is created), or ``":memory:"``.
        max_count: most rows kept (>= 1).
        max_bytes: most payload bytes kept (>= 1); a single payload larger than this is not stored.
        ttl_s: seconds a row may go unused before it expires (> 0).
        clock: the time source (seconds); tests pass a fake one.

    Raises:
        ValueError: a bound < 1.
        sqlite3.Error: the file cannot be opened as a database.
    """

    def __init__(self, path: str | os.PathLike, max_count: int = 10_000, max_bytes: int = 256 << 20,
                 ttl_s: float = 7 * 86400.0, clock=time.time) -> None:
        if max_count < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError(f"responses store bounds must be positive (max_count={max_count}, "
                             f"max_bytes={max_bytes}, ttl_s={ttl_s})")
        self.path = str(path)
        self.max_count, self.max_bytes, self.ttl_s = max_count, max_bytes, ttl_s
        self._clock = clock
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(os.path.expanduser(self.path), check_same_thread=False, isolation_level=None,
                                   timeout=10.0)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            count, nbytes = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses").fetchone()
        self._count, self._bytes = int(count), int(nbytes)  # running totals (one server per file)
        self.evicted = 0  # rows evicted by the bounds (not by TTL) since start
        self.expired = 0  # rows expired by the TTL since start

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ writes
    def put(self, response_id: str, owner: str, data: bytes) -> bool:
        """Store (or replace) ``data`` under ``response_id``; then expire and evict down to the bounds.
        Returns False (nothing stored) when ``data`` alone exceeds ``max_bytes``."""
        if len(data) > self.max_bytes:
            logger.warning("response %s not stored: %d bytes > the store's max_bytes %d", response_id, len(data),
                           self.max_bytes)
            return False
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            totals = self._count, self._bytes
            try:
                old = self._db.execute("SELECT nbytes FROM responses WHERE id = ?", (response_id,)).fetchone()
                if old is not None:
                    self._count, self._bytes = self._count - 1, self._bytes - old[0]
                self._db.execute("INSERT OR REPLACE INTO responses (id, owner, created, last_used, nbytes, data) "
                                 "VALUES (?, ?, ?, ?, ?, ?)", (response_id, owner, now, now, len(data), data))
                self._count, self._bytes = self._count + 1, self._bytes + len(data)
                self._expire_locked(now)
                self._evict_locked()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._count, self._bytes = totals
                raise
        return True

    def _expire_locked(self, now: float) -> None:
        cutoff = now - self.ttl_s
        count, nbytes = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses "
                                         "WHERE last_used < ?", (cutoff,)).fetchone()
        if count:
            self._db.execute("DELETE FROM responses WHERE last_used < ?", (cutoff,))
            self._count, self._bytes = self._count - count, self._bytes - nbytes
            self.expired += count

    def _evict_locked(self) -> None:
        if self._count <= self.max_count and self._bytes <= self.max_bytes:
            return
        # least recently used first: drop rows until both bounds hold
        drop, freed = [], 0
        for rid, size in self._db.execute("SELECT id, nbytes FROM responses ORDER BY last_used"):
            if self._count - len(drop) <= self.max_count and self._bytes - freed <= self.max_bytes:
                break
            drop.append((rid,))
            freed += size
        self._db.executemany("DELETE FROM responses WHERE id = ?", drop)
        self._count, self._bytes = self._count - len(drop), self._bytes - freed
        self.evicted += len(drop)

    def delete(self, response_id: str, owner: str) -> bool:
        """Delete ``response_id`` if ``owner`` stored it; True if a row was deleted."""
        with self._lock:
            row = self._db.execute("SELECT nbytes FROM responses WHERE id = ? AND owner = ?",
                                   (response_id, owner)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self._count, self._bytes = self._count - 1, self._bytes - row[0]
            return True

    # ------------------------------------------------------------------ reads
    def get(self, response_id: str, owner: str) -> bytes | None:
        """The payload of ``response_id`` if ``owner`` stored it and it has not expired (its ``last_used`` is
        refreshed: the LRU order); else None."""
        now = self._clock()
        with self._lock:
            row = self._db.execute("SELECT data, last_used FROM responses WHERE id = ? AND owner = ?",
                                   (response_id, owner)).fetchone()
            if row is None:
                return None
            if row[1] < now - self.ttl_s:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                self._count, self._bytes = self._count - 1, self._bytes - len(row[0])
                self.expired += 1
                return None
            self._db.execute("UPDATE responses SET last_used = ? WHERE id = ?", (now, response_id))
            return bytes(row[0])

    def stats(self) -> tuple[int, int]:
        """``(rows, payload bytes)`` stored now (counted by SQLite, not the running totals)."""
        with self._lock:
            count, nbytes = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses").fetchone()
        return int(count), int(nbytes)
