"""mooncake.mooncake_ep_buffer: Mooncake EP's Python ``Buffer`` and ``EventOverlap`` under
upstream's module path, as SGLang imports them::

    from mooncake.mooncake_ep_buffer import Buffer
    buf = Buffer(group, Buffer.get_ep_buffer_size_hint(M, H, group.size(), E))
    recv, count, handle, event, hook = buf.dispatch(x, topk_idx, active_ranks, M, E, -1,
                                                    async_finish=True)
    event.current_stream_wait()
    out, event, hook = buf.combine(y, topk_idx, topk_weights, active_ranks, -1, handle)

Upstream's signatures (``timeout_us`` required, -1 = no timeout) over mooncake.ep.Buffer
(docs/ep.md and docs/compat.md). The returned event is an EventOverlap. Upstream's buffer is
always on the current CUDA device, and so is this one where torch has CUDA and mooncake was
built with it (its calls then take CUDA tensors, as SGLang passes them); otherwise it is in host
memory and takes CPU tensors.
``device=`` picks another place (any of mooncake.ep.Buffer's: "cpu", "cuda[:N]", "gpu[:N]").
"""


import torch

from . import ep as _ep

__all__ = ["Buffer", "EventOverlap"]


def _cuda_build():
    """Whether this mooncake was built with CUDA (its backend then serves "cuda")."""
    from . import _C
    return "cuda" in getattr(_C, "DEVICES", ())


class EventOverlap:
    """Upstream's event wrapper: ``event`` (the native event, or None when the call already
    finished), ``extra_tensors`` (kept alive with it), ``current_stream_wait()`` and ``with``
    (both wait for the operation; CPU tensors have no stream)."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.event is not None:
            self.event.current_stream_wait()


class Buffer:
    """Mooncake EP's Buffer on a mooncake process group (collective: every rank constructs it).

    ``num_ep_buffer_bytes``: from ``get_ep_buffer_size_hint``; ``disable_p2p``: reach every peer
    through engine WRITEs, never by storing into its mapped buffer."""

    def __init__(self, group, num_ep_buffer_bytes=0, disable_p2p=False, device=None):
        if not num_ep_buffer_bytes or int(num_ep_buffer_bytes) <= 0:
            raise ValueError("num_ep_buffer_bytes must be positive "
                             "(Buffer.get_ep_buffer_size_hint)")
        if device is None:
            device = "cuda" if _cuda_build() and torch.cuda.is_available() else "cpu"
        self.group = group
        self._buf = _ep.Buffer(group, int(num_ep_buffer_bytes), disable_p2p=bool(disable_p2p),
                               device=device)
        self.runtime = self._buf
        self._took_members()

    def _took_members(self):
        self.rank = self._buf.rank
        self.group_size = self._buf.group_size
        self.num_ep_buffer_bytes = self._buf.num_ep_buffer_bytes

    def update_ep_member(self):
        """Collective, after pg.recover_ranks (a replacement process constructs its Buffer
        instead): mooncake.ep.Buffer.update_ep_member."""
        self._buf.update_ep_member()
        self._took_members()

    def connect(self, is_update=False):
        """Upstream's (its constructor connects): the same collective as update_ep_member."""
        self.update_ep_member()

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                num_experts):
        return _ep.Buffer.get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                                  num_ranks, num_experts)

    def _active(self, active_ranks):
        """None: all ranks. Anything but a tensor of one entry per rank is a ValueError (a
        replacement would hide the caller's mask and the failures marked in it)."""
        if active_ranks is None:
            return self._ones()
        if not isinstance(active_ranks, torch.Tensor) or \
                active_ranks.numel() != self.group_size:
            what = (f"{active_ranks.numel()} entries" if isinstance(active_ranks, torch.Tensor)
                    else type(active_ranks).__name__)
            raise ValueError(f"rank {self.rank}: active_ranks must be a tensor of "
                             f"{self.group_size} entries (one per rank), not {what}")
        return active_ranks

    def _fp8(self, x, use_fp8):
        if use_fp8 is not None:
            return bool(use_fp8)
        dev = self._buf.device
        return bool(dev and dev.startswith("cuda") and getattr(x, "dtype", None) == torch.bfloat16)

    def _ones(self):
        """All ranks active, where the buffer's calls want their tensors."""
        t = torch.ones(self.group_size, dtype=torch.int32)
        dev = self._buf.device
        if dev is None:
            return t
        if dev.startswith("cuda"):
            return t.to(dev)
        from . import _C  # the device layer's own memory (its simulation in the tests)
        d = _C._device_empty_like(t, int(dev.partition(":")[2] or 0))
        _C._device_copy(d.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
        return d

    def dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts,
                 timeout_us, use_fp8=None, async_finish=False, return_recv_hook=False):
        """Returns (recv_x, recv_count, handle, EventOverlap, hook). use_fp8=True sends fp8
        and recv_x is (e4m3, scales), as upstream; None: fp8 for bfloat16 x on a CUDA buffer
        (upstream's default there), the rows as they are otherwise."""
        # Argument errors here give the round up on every rank (mooncake.ep's _round).
        with self._buf._round("dispatch"):
            if async_finish and return_recv_hook:
                raise ValueError("async_finish and return_recv_hook cannot both be set")
            active, fp8 = self._active(active_ranks), self._fp8(x, use_fp8)
        recv_x, count, handle, event, hook = self._buf.dispatch(
            x, topk_idx, active, num_max_dispatch_tokens_per_rank, num_experts,
            timeout_us=timeout_us, use_fp8=fp8, async_finish=async_finish,
            return_recv_hook=return_recv_hook)
        return recv_x, count, handle, EventOverlap(event), hook

    def combine(self, x, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                zero_copy=False, async_finish=False, return_recv_hook=False, out=None):
        """Returns (combined_x, EventOverlap, hook). zero_copy=True: NotImplementedError (as
        upstream's)."""
        with self._buf._round("combine"):
            if async_finish and return_recv_hook:
                raise ValueError("async_finish and return_recv_hook cannot both be set")
            active = self._active(active_ranks)
        combined, event, hook = self._buf.combine(
            x, topk_idx, topk_weights, active, timeout_us, handle,
            zero_copy=zero_copy, async_finish=async_finish, return_recv_hook=return_recv_hook,
            out=out)
        return combined, EventOverlap(event), hook

    def get_next_combine_buffer(self, handle):
        raise NotImplementedError("Mooncake EP zero-copy combine is not supported")
