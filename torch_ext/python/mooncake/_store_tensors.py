"""The tensor calls of MooncakeDistributedStore (upstream's names and return conventions).

A tensor object is a small header (dtype, shape) followed by the tensor's bytes, written and read
whole (a non-contiguous tensor is made contiguous). Tensors to write may be CUDA tensors (copied
to the host first: the object is one piece, header and bytes); the ``*_into`` calls on a
registered GPU buffer move the bytes straight into it and return a tensor viewing it there.
Tensor-parallel calls store shard ``i`` of ``tp_size`` under ``f"{key}_tp_{i}"`` (upstream's key naming); the unified parallel
calls (``*_with_parallelism``) take one "tp" axis and use the same shard keys (other axis kinds
are refused with INVALID_PARAMS; docs/compat.md).
"""

import torch

from . import _C
from ._store_types import ReadTarget, native_config

_BAD = -600


def _host(t):
    """t itself when its bytes are host memory; else a CPU copy (a CUDA tensor through torch,
    so after the kernels queued on the current stream; a tensor on the device layer's
    simulated GPU memory through the layer's copies, whole storage first: host code must not
    touch that memory); None for a tensor on another device."""
    if not isinstance(t, torch.Tensor):
        return None
    if t.device.type == "cuda":
        return t.detach().cpu()
    if t.device.type != "cpu":
        return None
    st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    n = st.nbytes()
    if n == 0 or not _C._is_device_memory(st.data_ptr()):
        return t
    raw = torch.empty(n, dtype=torch.uint8)
    _C._device_copy(raw.data_ptr(), st.data_ptr(), n)
    return torch.as_strided(raw.view(t.dtype), t.size(), t.stride(), t.storage_offset())


def _tensor_parts(t):
    """(header bytes, data as a bytes-like) of a tensor (GPU tensors through a host copy), or
    None."""
    t = _host(t)
    if t is None:
        return None
    t = t.detach().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() > 0 else b""
    return _C.tensor_header(t), data


def _shard_key(key, rank):
    return f"{key}_tp_{rank}"


def _tp_axis(parallelism):
    """The one tp axis of a TensorParallelism, or None when it has another shape."""
    axes = list(getattr(parallelism, "axes", []) or [])
    if len(axes) != 1 or str(axes[0].kind).lower() != "tp":
        return None
    return axes[0]


class TensorApi:
    """Mixed into MooncakeDistributedStore (which provides put_parts, upsert_parts, get,
    get_into, register checks and _cfg)."""

    # ---- whole tensors ----
    def _write_tensor(self, key, tensor, config, upsert):
        parts = _tensor_parts(tensor)
        if parts is None:
            return _BAD
        f = self.upsert_parts if upsert else self.put_parts
        return f(key, *parts, config=config)

    def put_tensor(self, key, tensor):
        return self._write_tensor(key, tensor, None, False)

    def pub_tensor(self, key, tensor, config=None):
        return self._write_tensor(key, tensor, config, False)

    def upsert_tensor(self, key, tensor):
        return self._write_tensor(key, tensor, None, True)

    def upsert_pub_tensor(self, key, tensor, config=None):
        return self._write_tensor(key, tensor, config, True)

    def _batch(self, keys, tensors, fn):
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            return [_BAD] * len(keys)
        return [fn(k, t) for k, t in zip(keys, tensors)]

    def batch_put_tensor(self, keys, tensors_list):
        return self._batch(keys, tensors_list, self.put_tensor)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        return self._batch(keys, tensors_list, lambda k, t: self.pub_tensor(k, t, config))

    def batch_upsert_tensor(self, keys, tensors_list):
        return self._batch(keys, tensors_list, self.upsert_tensor)

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        return self._batch(keys, tensors_list, lambda k, t: self.upsert_pub_tensor(k, t, config))

    def get_tensor(self, key):
        """The tensor (CPU, dtype and shape restored), or None."""
        raw = self.get(key)
        if not raw:
            return None
        buf = bytearray(raw)
        view = _C.tensor_view(_addr(buf), len(buf))
        if view is None:
            return None
        return view.clone()

    def batch_get_tensor(self, keys):
        return [self.get_tensor(k) for k in keys]

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads the tensor object into the registered buffer; a tensor viewing that buffer
        (valid while the buffer is), or None."""
        if not buffer_ptr:
            return None
        n = self.get_into(key, int(buffer_ptr), int(size))
        if n <= 0:
            return None
        return _C.tensor_view(int(buffer_ptr), n)

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(ptrs) == len(sizes)) or not self._c.is_setup() or \
                any(not p for p in ptrs):
            return [_BAD] * len(keys)  # upstream: codes instead of tensors on bad input
        got = self.batch_get_into(keys, ptrs, sizes)
        return [_C.tensor_view(int(p), n) if n > 0 else None for p, n in zip(ptrs, got)]

    def put_tensor_from(self, key, buffer_ptr, size):
        """The registered buffer holds a serialized tensor object (header + bytes)."""
        if _C.tensor_view(int(buffer_ptr), int(size)) is None:
            return _BAD
        return self.put_from(key, buffer_ptr, size)

    def upsert_tensor_from(self, key, buffer_ptr, size):
        if _C.tensor_view(int(buffer_ptr), int(size)) is None:
            return _BAD
        return self.upsert_from(key, buffer_ptr, size)

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes):
        return [self.put_tensor_from(k, p, n) for k, p, n in zip(keys, buffer_ptrs, sizes)]

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes):
        return [self.upsert_tensor_from(k, p, n) for k, p, n in zip(keys, buffer_ptrs, sizes)]

    # ---- tensor parallel (legacy *_with_tp) ----
    def _write_tp(self, key, tensor, config, tp_size, split_dim, upsert):
        if int(tp_size) <= 1:
            return self._write_tensor(key, tensor, config, upsert)
        tensor = _host(tensor)  # once for all shards (a shard's own staging is then a no-op)
        if tensor is None or tensor.dim() == 0 or \
                not -tensor.dim() <= split_dim < tensor.dim() or \
                tensor.shape[split_dim] % int(tp_size) != 0:
            return _BAD
        for i, shard in enumerate(torch.chunk(tensor, int(tp_size), int(split_dim))):
            rc = self._write_tensor(_shard_key(key, i), shard, config, upsert)
            if rc:
                return rc
        return 0

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """tp_size > 1: all tp_size shards of the full tensor, along split_dim, under
        key_tp_<i> (tp_rank is not used, as upstream)."""
        return self._write_tp(key, tensor, None, tp_size, split_dim, False)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        return self._write_tp(key, tensor, config, tp_size, split_dim, False)

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1,
                                 split_dim=0):
        return self._batch(base_keys, tensors_list, lambda k, t: self._write_tp(
            k, t, None, tp_size, split_dim, False))

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0,
                                 tp_size=1, split_dim=0):
        return self._batch(base_keys, tensors_list, lambda k, t: self._write_tp(
            k, t, config, tp_size, split_dim, False))

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        if int(tp_size) <= 1:
            return self.get_tensor(key)
        return self.get_tensor(_shard_key(key, int(tp_rank)))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        return [self.get_tensor_with_tp(k, tp_rank, tp_size) for k in base_keys]

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        k = key if int(tp_size) <= 1 else _shard_key(key, int(tp_rank))
        return self.get_tensor_into(k, buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0,
                                      tp_size=1):
        keys = [k if int(tp_size) <= 1 else _shard_key(k, int(tp_rank)) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1,
                                split_dim=0):
        """The registered buffer holds a serialized full tensor; stored as put_tensor_with_tp."""
        t = _C.tensor_view(int(buffer_ptr), int(size))
        if t is None:
            return _BAD
        return self.put_tensor_with_tp(key, t, tp_rank, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0,
                                      tp_size=1, split_dim=0):
        return [self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
                for k, p, n in zip(base_keys, buffer_ptrs, sizes)]

    # ---- the unified parallel API (one tp axis) ----
    def _write_par(self, key, tensor, parallelism, config, writer_partition, upsert):
        if parallelism is not None and writer_partition is not None:
            return _BAD
        if writer_partition is not None:  # this writer holds shard `rank` of `size`
            r, n, d = (getattr(writer_partition, a, None) for a in ("rank", "size", "split_dim"))
            if not (isinstance(n, int) and n > 0 and isinstance(r, int) and 0 <= r < n and
                    isinstance(d, int) and d >= 0):
                return _BAD
            if n == 1:
                return self._write_tensor(key, tensor, config, upsert)
            return self._write_tensor(_shard_key(key, r), tensor, config, upsert)
        if parallelism is None:
            return self._write_tensor(key, tensor, config, upsert)
        ax = _tp_axis(parallelism)
        if ax is None:
            return _BAD
        return self._write_tp(key, tensor, config, ax.size, ax.split_dim or 0, upsert)

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                    writer_partition=None):
        return self._write_par(key, tensor, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                       writer_partition=None):
        return self._write_par(key, tensor, parallelism, config, writer_partition, True)

    def _batch_par(self, keys, tensors, parallelisms, config, writer_partitions, upsert):
        keys, tensors = list(keys), list(tensors)
        ps = list(parallelisms) if parallelisms is not None else [None] * len(keys)
        ws = list(writer_partitions) if writer_partitions is not None else [None] * len(keys)
        if not (len(keys) == len(tensors) == len(ps) == len(ws)):
            return [_BAD] * len(keys)
        return [self._write_par(k, t, p, config, w, upsert)
                for k, t, p, w in zip(keys, tensors, ps, ws)]

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                          config=None, writer_partitions=None):
        return self._batch_par(keys, tensors_list, parallelisms, config, writer_partitions,
                               False)

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                             config=None, writer_partitions=None):
        return self._batch_par(keys, tensors_list, parallelisms, config, writer_partitions,
                               True)

    def _from_buffer_par(self, keys, buffer_ptrs, sizes, parallelisms, config,
                         writer_partitions, upsert):
        ts = [_C.tensor_view(int(p), int(n)) for p, n in zip(buffer_ptrs, sizes)]
        return self._batch_par(keys, ts, parallelisms, config, writer_partitions, upsert)

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                         config=None, writer_partition=None):
        return self._from_buffer_par([key], [buffer_ptr], [size], [parallelism], config,
                                     [writer_partition], False)[0]

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                            config=None, writer_partition=None):
        return self._from_buffer_par([key], [buffer_ptr], [size], [parallelism], config,
                                     [writer_partition], True)[0]

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                               parallelisms=None, config=None,
                                               writer_partitions=None):
        return self._from_buffer_par(keys, buffer_ptrs, sizes, parallelisms, config,
                                     writer_partitions, False)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                                  parallelisms=None, config=None,
                                                  writer_partitions=None):
        return self._from_buffer_par(keys, buffer_ptrs, sizes, parallelisms, config,
                                     writer_partitions, True)

    def get_tensor_with_parallelism(self, key, target=None):
        """target None / "as_stored": the tensor stored under key. "shard": the reader's shard
        (target.parallelism's tp axis): its shard key, else cut from the whole tensor. "full":
        the whole tensor, else its shards key_tp_0.. concatenated along the axis's split_dim."""
        t = target if target is not None else ReadTarget()
        if t.mode == "as_stored":
            return self.get_tensor(key)
        ax = _tp_axis(t.parallelism) if t.parallelism is not None else None
        d = (ax.split_dim or 0) if ax is not None else 0
        if t.mode == "shard":
            if ax is None:
                return None
            shard = self.get_tensor(_shard_key(key, ax.rank))
            if shard is not None:
                return shard
            whole = self.get_tensor(key)
            if whole is None or whole.shape[d] % ax.size:
                return None
            return torch.chunk(whole, ax.size, d)[ax.rank].clone()
        whole = self.get_tensor(key)
        if whole is not None:
            return whole
        shards, i = [], 0
        while ax is None or i < ax.size:
            s = self.get_tensor(_shard_key(key, i))
            if s is None:
                break
            shards.append(s)
            i += 1
        if not shards or (ax is not None and len(shards) != ax.size):
            return None
        return torch.cat(shards, d)

    def batch_get_tensor_with_parallelism(self, keys, targets=None):
        ts = list(targets) if targets is not None else [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, ts)]

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        """As get_tensor_with_parallelism, written into the buffer as a tensor object; a
        tensor viewing the buffer, or None (also when it does not fit)."""
        t = self.get_tensor_with_parallelism(key, target)
        if t is None or not buffer_ptr:
            return None
        header, data = _tensor_parts(t)
        n = len(header) + t.numel() * t.element_size()
        if n > int(size):
            return None
        import ctypes
        ctypes.memmove(int(buffer_ptr), header, len(header))
        if t.numel():
            ctypes.memmove(int(buffer_ptr) + len(header), data.ctypes.data, n - len(header))
        return _C.tensor_view(int(buffer_ptr), n)

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes, targets=None):
        ts = list(targets) if targets is not None else [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, n, t)
                for k, p, n, t in zip(keys, buffer_ptrs, sizes, ts)]


def _addr(buf):
    import ctypes
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


__all__ = ["TensorApi", "native_config"]
