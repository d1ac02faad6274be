"""Decompressing a capture's chunks ahead of the code that reads them, on worker threads.

zstd releases the GIL while it decompresses, so a reader that walks every chunk (`records()`, `replay info`, the report)
need not wait for one chunk's decompression before it starts the next: the workers decompress the next chunks while the
caller decodes this one, or side by side when the caller only verifies them (a scan; its speed-up is in
docs/performance.md, "Capture format"). Results come back in the order of the chunks, and at most `ahead` chunks are
held decompressed at a time, so a scan's memory stays flat however long the capture is.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain, islice
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 4  # zstd decompresses at ~1 GB/s a core; past a few cores the caller's own work is what limits
# A walk over fewer items runs on the caller's thread. A capture's first chunk holds little but its header and
# its last is seldom full, so a 4-chunk capture is about two chunks of work: too little for threads that start
MIN_AHEAD = 5


def default_workers() -> int:
    """Worker threads for this machine: none on one core (nothing runs beside the caller), else up to four."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cores < 2 else min(MAX_WORKERS, cores)


class ReadAhead:
    """An ordered, bounded `map` over worker threads (threads start on first use; `close` stops them).

    `workers=0` runs every call inline, on the caller's thread."""

    def __init__(self, workers: int):
        self.workers = workers
        self.ahead = workers + 1  # one more than the workers: the next result is ready when the caller wants it
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: Iterable[T], catch: tuple[type[BaseException], ...]
            ) -> Iterator[tuple[T, R | None, BaseException | None]]:
        """(item, fn(item), None) for each item in order, or (item, None, error) where fn raised one of `catch`
        (anything else propagates). Items are drawn from `items` on the caller's thread, `ahead` at most ahead of
        what was yielded; results never yielded (the caller stopped early) are cancelled or dropped."""
        source = iter(items)
        # A short walk (one step's chunk, a small capture) runs inline: starting threads costs more than they save
        # on a few items
        first = list(islice(source, MIN_AHEAD)) if self.workers else []
        if len(first) < MIN_AHEAD:  # (then `source` is exhausted, unless there are no workers)
            yield from _inline(fn, chain(first, source), catch)
            return
        source = chain(first, source)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="replay-capture-read")
        pool = self._pool
        pending: deque[tuple[T, Future]] = deque()

        def top_up() -> None:
            while len(pending) < self.ahead:
                item = next(source, _END)
                if item is _END:
                    return
                pending.append((item, pool.submit(fn, item)))

        try:
            top_up()
            while pending:
                item, fut = pending.popleft()
                try:
                    result, error = fut.result(), None
                except catch as e:
                    result, error = None, e
                top_up()
                yield item, result, error
        finally:
            for _, fut in pending:
                fut.cancel()

    def close(self) -> None:
        """Stop the worker threads, waiting for calls already running (they may still read the file)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


_END = object()


def _inline(fn: Callable[[T], R], items: Iterable[T], catch: tuple[type[BaseException], ...]
            ) -> Iterator[tuple[T, R | None, BaseException | None]]:
    for item in items:
        try:
            yield item, fn(item), None
        except catch as e:
            yield item, None, e
