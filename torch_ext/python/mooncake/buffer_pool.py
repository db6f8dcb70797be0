"""mooncake.BufferPool (= RegisteredBufferPool): leases of registered memory for a store's
zero-copy calls (put_from, get_into, batch_*), as upstream's wheel exposes it.

Leases come from the store's local buffer first (``local_buffer_size`` of setup). When it is
full, an overflow region (page-aligned host memory registered with ``store.register_buffer``)
serves the lease; released overflow regions are kept for reuse by size class (powers of two from
``min_size_class``) up to ``max_regions``, and unregistered on ``close()``. ``max_bytes`` bounds
what the pool lends at once (0: twice the local buffer); past it, ``acquire`` waits for a release
(``block_on_exhaustion``) or raises.
"""

import threading
import time

from ._store_types import MooncakeHostMemAllocator


class BufferLease:
    """``ptr``, ``size``, ``buffer`` (a writable memoryview of ``size`` bytes); ``release()``
    (also on leaving a ``with`` block)."""

    def __init__(self, pool, ptr, size, handle=None, region=None):
        self._pool, self._ptr, self._size = pool, ptr, size
        self._handle, self._region = handle, region
        self._closed = False

    def _check(self):
        if self._closed:
            raise RuntimeError("buffer lease is closed")

    @property
    def ptr(self):
        self._check()
        return self._ptr

    @property
    def size(self):
        self._check()
        return self._size

    @property
    def buffer(self):
        self._check()
        if self._handle is not None:
            return memoryview(self._handle).cast("B")[:self._size]
        import ctypes
        return memoryview((ctypes.c_ubyte * self._size).from_address(self._ptr)).cast("B")

    def release(self):
        if not self._closed:
            self._closed = True
            self._pool._release(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class BufferPool:
    def __init__(self, store, max_bytes=0, min_size_class=64 * 1024, max_size_class=None,
                 alignment=8 * 1024 * 1024, block_on_exhaustion=True, default_timeout=None,
                 max_regions=None, prewarm_size=None, prewarm_count=0):
        c = getattr(store, "_c", None)
        if c is None or not c.is_setup():
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if c.local_buffer_size == 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store, self._c = store, c
        self._max_bytes = int(max_bytes) or 2 * c.local_buffer_size
        self._min_class = max(4096, int(min_size_class))
        self._max_class = int(max_size_class) if max_size_class else None
        self._block = bool(block_on_exhaustion)
        self._timeout = default_timeout
        self._max_regions = max_regions
        self._alloc = MooncakeHostMemAllocator()
        self._cv = threading.Condition()
        self._lent = 0          # bytes lent now (local and overflow)
        self._active = 0        # leases not yet released
        self._free = {}         # size class -> [overflow region address] kept for reuse
        self._regions = 0       # overflow regions allocated and registered
        self._closed = False
        if prewarm_size and prewarm_count:
            self.prewarm(prewarm_size, prewarm_count)

    def _class_of(self, size):
        c = self._min_class
        while c < size:
            c <<= 1
        return c

    def _new_region(self, cls):
        if self._max_regions is not None and self._regions >= self._max_regions:
            return None
        p = self._alloc.alloc(cls)
        if self._store.register_buffer(p, cls) != 0:
            self._alloc.free(p)
            raise RuntimeError(f"cannot register an overflow buffer of {cls} bytes")
        self._regions += 1
        return p

    def prewarm(self, size, count):
        """Allocates and registers ``count`` overflow regions of ``size``'s class now."""
        cls = self._class_of(int(size))
        with self._cv:
            for _ in range(int(count)):
                p = self._new_region(cls)
                if p is None:
                    break
                self._free.setdefault(cls, []).append(p)

    def acquire(self, size, block=None, timeout=None):
        size = int(size)
        if size <= 0:
            raise ValueError("buffer size must be positive")
        if size > self._max_bytes or (self._max_class and size > self._max_class):
            raise RuntimeError("requested buffer size exceeds pool capacity")
        block = self._block if block is None else block
        timeout = self._timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                if self._lent + size <= self._max_bytes:
                    lease = self._take(size)
                    if lease is not None:
                        self._lent += size
                        self._active += 1
                        return lease
                if not block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cv.wait(left)

    buffer = acquire  # for `with pool.buffer(n) as lease:`

    def _take(self, size):
        h = self._c.lease(size)
        if h is not None:
            return BufferLease(self, h.ptr(), size, handle=h)
        cls = self._class_of(size)
        free = self._free.get(cls)
        p = free.pop() if free else self._new_region(cls)
        return None if p is None else BufferLease(self, p, size, region=(p, cls))

    def _release(self, lease):
        with self._cv:
            lease._handle = None  # the local-buffer slice returns with the handle
            if lease._region is not None:
                p, cls = lease._region
                self._free.setdefault(cls, []).append(p)
            self._lent -= lease._size
            self._active -= 1
            self._cv.notify_all()

    def close(self):
        with self._cv:
            if self._active:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            for regions in self._free.values():
                for p in regions:
                    self._store.unregister_buffer(p)
                    self._alloc.free(p)
            self._free.clear()
            self._cv.notify_all()


RegisteredBufferPool = BufferPool

__all__ = ["BufferPool", "BufferLease", "RegisteredBufferPool"]
