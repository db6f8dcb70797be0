"""Expert-parallel dispatch/combine (DeepEP's low-latency and normal modes) on a mooncake
process group.

    import torch.distributed as dist
    import mooncake
    from mooncake.ep import Buffer

    dist.init_process_group("mooncake")
    nbytes = Buffer.get_ep_buffer_size_hint(M, H, R, E)
    buf = Buffer(dist.group.WORLD, num_ep_buffer_bytes=nbytes)
    recv_x, recv_count, handle, event, hook = buf.dispatch(
        x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank=M, num_experts=E)
    out, event, hook = buf.combine(y, topk_idx, topk_weights, active_ranks, timeout_us, handle)

The buffer is allocated once from the group's transfer engine (registered memory) and
every rank writes the rows it sends straight into the destination's buffer (one copy per
token on one host). Every rank must call dispatch/combine in the same order with the same
M, H, E and dtype.

``Buffer(..., device="cuda")`` (or ``"cuda:N"``, a torch.device, or ``"gpu[:N]"``: device N
of the engine's device layer, the host simulation under ``MC_DEVICE=sim``) puts the buffer in
GPU memory: the buffer of every rank on this host is opened through its CUDA IPC handle
(ranks on other hosts are reached by the buffer's host proxy thread, which moves the rows
the kernels stage through the engine), dispatch/combine of both modes take tensors on that
device (x, topk_idx,
topk_weights, active_ranks and the handles) and return outputs there, and the kernels
(ep/kernels/ll_kernels.h, normal_kernels.h) do the copies. On CUDA (MC_EP_STREAM_CALLS)
low-latency dispatch/combine are stream-ordered: queued behind the caller's current stream,
which then waits for them (or, with async_finish, event.current_stream_wait() makes it), with
no host wait; a failure the kernels find (a bad expert id, a peer that gave the round up)
raises from the buffer's next call or event.wait(). Otherwise, and in normal mode, each call
waits on the host for the kernels the caller queued on its current stream and for its own.
No CUDA graph capture yet (docs/ep.md).

``use_fp8=True`` (low-latency dispatch, bfloat16 x, H a multiple of 128) sends each token as
DeepEP does: per 128 channels, amax = max(|x|, 1e-4), the bytes e4m3(x * 448 / amax) and the
scale amax / 448; recv_x is then the tuple (e4m3 [L, R*M, H], scales float32 [L, R*M,
H/128]) with x ~= e4m3.float() * scale. The e4m3 tensor is torch.float8_e4m3fn (its raw bytes
as uint8 on torch < 2.1). The rounding is ep/kernels/numerics.h's, shared with the kernels.

Failure awareness (low-latency mode): ``active_ranks`` (int32 [R], 1 = active) is updated
in place: a rank that sends nothing within ``timeout_us`` is set to 0, counted as having
sent no tokens and skipped by combine; ranks already 0 are neither sent to nor waited for.
``timeout_us=-1``: no timeout (a silent rank is waited for until its engine is seen gone).
On an elastic group, after ``pg.recover_ranks`` put a replacement process in a dead rank's slot,
``update_ep_member()`` on the other ranks meets the replacement's constructor (docs/ep.md,
"Replaced ranks").
"""

import contextlib

import torch
import torch.distributed as dist

from . import _C
# Upstream's mooncake.ep also carried its process-group module's functions (older SGLang calls
# mooncake.ep.set_host_ip / set_device_filter and imports MooncakeBackendOptions and
# get_active_ranks from here): the very objects of mooncake.pg.
from .pg import (  # noqa: F401
    MooncakeBackendOptions, ProposalStatus, ProposeViewUpdateResponse, SyncAfterFailureResponse,
    SyncAfterFailureStatus, ViewUpdateStatus, activate_ranks, deactivate_ranks,
    extend_group_size_to, get_active_ranks, get_current_epoch, get_device_filter,
    get_failed_ranks_hint, get_local_success, get_num_synced_ranks, get_peer_state, join_group,
    recover_ranks, set_collective_timeout_us, set_device_filter,
    set_fault_reconciliation_window_us, set_host_ip, set_p2p_timeout_us, set_transfer_engine,
    sync_after_failure)

__all__ = ["Buffer", "EpHandle", "NormalHandle", "dispatch_autograd", "combine_autograd",
           "MooncakeBackendOptions", "ProposalStatus", "ProposeViewUpdateResponse",
           "SyncAfterFailureResponse", "SyncAfterFailureStatus", "ViewUpdateStatus",
           "activate_ranks", "deactivate_ranks", "extend_group_size_to", "get_active_ranks",
           "get_current_epoch", "get_device_filter", "get_failed_ranks_hint",
           "get_local_success", "get_num_synced_ranks", "get_peer_state", "join_group",
           "recover_ranks", "set_collective_timeout_us", "set_device_filter",
           "set_fault_reconciliation_window_us", "set_host_ip", "set_p2p_timeout_us",
           "set_transfer_engine", "sync_after_failure"]

DEFAULT_TIMEOUT_US = 10_000_000


def _mooncake_backend(group):
    """The _C.ProcessGroupMooncake behind a torch.distributed group."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if isinstance(group, _C.ProcessGroupMooncake):
        return group
    get_backend = getattr(group, "_get_backend", None)  # torch >= 2.1: facade over backends
    if get_backend is not None:
        try:
            b = get_backend(torch.device("cpu"))
        except RuntimeError:
            b = None
        if isinstance(b, _C.ProcessGroupMooncake):
            return b
    raise ValueError("mooncake.ep.Buffer needs a process group created with backend "
                     f"'mooncake', got {type(group).__name__}")


def _device_arg(device):
    """(ordinal, cuda) for Buffer's device argument; (-1, False): host memory."""
    if device is None:
        return -1, False
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    else:
        kind, _, idx = str(device).partition(":")
        try:
            index = int(idx) if idx else None
        except ValueError:
            raise ValueError(f"ep.Buffer: device {device!r}: expected cpu, cuda[:N] or gpu[:N]")
    if kind == "cpu":
        return -1, False
    if kind == "cuda":
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return int(index), True
    if kind == "gpu":
        return int(index or 0), False
    raise ValueError(f"ep.Buffer: device {device!r}: expected cpu, cuda[:N] or gpu[:N]")


class EpHandle(tuple):
    """Low-latency dispatch handle: (src_info, layout_range, M, H, E)."""

    __slots__ = ()

    def __new__(cls, src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
                num_experts):
        return super().__new__(cls, (src_info, layout_range, num_max_dispatch_tokens_per_rank,
                                     hidden, num_experts))


class NormalHandle(tuple):
    """Normal-mode dispatch handle: (is_token_in_rank [T, R] bool, recv_counts int32 [R],
    recv_src_idx int32 [N], recv_topk_idx, recv_topk_weights, num_experts)."""

    __slots__ = ()

    def __new__(cls, is_token_in_rank, recv_counts, recv_src_idx, recv_topk_idx,
                recv_topk_weights, num_experts):
        return super().__new__(cls, (is_token_in_rank, recv_counts, recv_src_idx, recv_topk_idx,
                                     recv_topk_weights, num_experts))

    is_token_in_rank = property(lambda self: self[0])
    recv_counts = property(lambda self: self[1])
    recv_src_idx = property(lambda self: self[2])
    recv_topk_idx = property(lambda self: self[3])
    recv_topk_weights = property(lambda self: self[4])
    num_experts = property(lambda self: self[5])


class Buffer:
    """An EP buffer on a mooncake process group (collective: every rank constructs it)."""

    def __init__(self, group=None, num_ep_buffer_bytes=None, disable_p2p=False, device=None):
        """disable_p2p: reach every peer through engine WRITEs, never by storing into its
        mapped buffer (Mooncake EP's switch off of its NVLink/IPC path; results are the same).
        device: None or "cpu" (host memory), "cuda[:N]" / torch.device (GPU memory of CUDA
        device N, default the current one), "gpu[:N]" (device N of the engine's device layer,
        whichever it is: CUDA, or the host simulation of the tests)."""
        backend = _mooncake_backend(group)
        if not num_ep_buffer_bytes:
            raise ValueError("num_ep_buffer_bytes is required and positive "
                             "(Buffer.get_ep_buffer_size_hint)")
        ordinal, cuda = _device_arg(device)
        self.group = group
        self._backend = backend  # keeps the group's communicator and engine alive
        self._args = (int(num_ep_buffer_bytes), bool(disable_p2p), ordinal, cuda)
        self._impl = _C.EpBuffer(backend, *self._args)
        self.device = None if ordinal < 0 else (f"cuda:{ordinal}" if cuda else f"gpu:{ordinal}")
        self.disable_p2p = bool(disable_p2p)
        self._took_members()

    def _took_members(self):
        self.rank = self._impl.rank
        self.group_size = self._impl.group_size
        self.num_ep_buffer_bytes = self._impl.num_bytes

    def update_ep_member(self):
        """Collective: connects the buffer again to the group's current members (Mooncake
        EP's, after pg.recover_ranks brought a replacement process into a slot). Every rank
        of the group calls it, except that a replacement process constructs its Buffer
        instead: both run the same exchange. Without a membership change it is a plain
        reconnect.

        The buffer is built anew (the same size, device and disable_p2p): every rank's
        rounds start over, so no call may be in flight on any rank, and handles of earlier
        dispatches must not be passed to combine afterwards. Calls this rank queued
        (async_finish) finish first; hooks and stream-ordered events of earlier calls keep
        the old buffer until they are dropped; otherwise its memory is freed (and unmapped
        by the peers) before the new one is allocated. A failure (a rank that does not take
        part within the group's timeout, a rank of an elastic group that is still inactive)
        raises RuntimeError on the ranks that took part and leaves the buffer unusable
        until a later update_ep_member succeeds."""
        was = self.group_size
        old, self._impl = self._impl, _Disconnected(self.rank, "update_ep_member is running")
        del old  # (its queued calls finish first; a hook or stream event may keep it longer)
        try:
            # (min_size: an elastic group's size ends at its highest active rank; while the
            # last ranks are inactive every rank's set-up fails, a replacement's too.)
            self._impl = _C.EpBuffer(self._backend, *self._args, min_size=was)
        except Exception as e:
            self._impl = _Disconnected(self.rank, f"update_ep_member failed: {e}")
            raise
        self._took_members()

    def connect(self, is_update=False):
        """Mooncake EP's (its constructor connects; update_ep_member() is connect(True)):
        the same collective as update_ep_member, whatever is_update says."""
        self.update_ep_member()

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                num_experts):
        """Bytes a Buffer needs for low-latency calls with these bounds (either dtype)."""
        return _C.EpBuffer.size_hint(int(num_max_dispatch_tokens_per_rank), int(hidden),
                                     int(num_ranks), int(num_experts))

    def is_mapped(self, rank):
        """True when `rank`'s buffer is reached by direct stores (same host)."""
        return self._impl.is_mapped(rank)

    # ---- low-latency mode ----
    def dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                 num_experts, timeout_us=DEFAULT_TIMEOUT_US, use_fp8=False, async_finish=False,
                 return_recv_hook=False):
        """Sends each token once to each of its experts.

        Returns (recv_x [L, R*M, H], recv_count int32 [L], handle, event, hook); with
        use_fp8, recv_x is (e4m3 [L, R*M, H], scales float32 [L, R*M, H/128]). For local
        expert l, rows [0, recv_count[l]) hold one contiguous block per active source rank
        r at handle's layout_range[l][r] = (begin << 32) | count; src_info[l][i] is the
        source token index. With async_finish the outputs are filled once event.wait()
        returns; with return_recv_hook the call only sends and hook() receives (at most
        two dispatches in flight: a third before the first one's hook() raises ValueError).
        """
        with self._round("dispatch"):
            self._tensors("dispatch", x=x, topk_idx=topk_idx, active_ranks=active_ranks)
            M, E, tmo = int(num_max_dispatch_tokens_per_rank), int(num_experts), int(timeout_us)
        recv_x, scales, recv_count, src_info, layout, event, hook = self._native(
            "dispatch", self._impl.dispatch, x, topk_idx, active_ranks, M, E, tmo,
            bool(use_fp8), bool(async_finish), bool(return_recv_hook))
        handle = EpHandle(src_info, layout, M, int(x.shape[1]), E)
        if use_fp8:
            recv_x = (recv_x, scales)
        return recv_x, recv_count, handle, event, hook

    def combine(self, y, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                zero_copy=False, async_finish=False, return_recv_hook=False, out=None):
        """out[t] = sum over k (ascending) with topk_idx[t][k] >= 0 and its owner active of
        topk_weights[t][k] * y_owner[row of t], accumulated in float32, rounded once.

        Returns (out [T, H], event, hook). zero_copy=True (y already in the buffer) is not
        supported, as in Mooncake EP: NotImplementedError. As dispatch: at most two combines
        in flight (return_recv_hook).
        """
        if zero_copy:
            raise NotImplementedError(
                "Mooncake EP zero-copy combine is not supported; pass the expert output tensor "
                "to combine() with zero_copy=False")
        with self._round("combine"):
            self._tensors("combine", y=y, topk_idx=topk_idx, topk_weights=topk_weights,
                          active_ranks=active_ranks)
            self._tensors("combine", optional=True, out=out)
            src_info, layout, M, H, E = handle
            tmo = int(DEFAULT_TIMEOUT_US if timeout_us is None else timeout_us)
            M, H, E = int(M), int(H), int(E)
        return self._native("combine", self._impl.combine, y, topk_idx, topk_weights,
                            active_ranks, tmo, src_info, layout, M, H, E, bool(async_finish),
                            bool(return_recv_hook), out)

    def get_dispatch_layout(self, topk_idx, num_experts):
        """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
        is_token_in_rank bool [T, R])."""
        return self._impl.get_dispatch_layout(topk_idx, int(num_experts))

    # ---- normal mode ----
    def normal_dispatch(self, x, topk_idx, topk_weights, num_experts, expert_alignment=1,
                        handle=None):
        """Sends each token once to each rank holding one of its experts.

        Returns (recv_x [N, H], recv_topk_idx int64 [N, K] (local expert id or -1),
        recv_topk_weights float32 [N, K] (0 where -1), num_recv_per_expert int32 [L]
        (aligned up to expert_alignment), handle). Rows are ordered by source rank, then
        token index. With `handle` (a NormalHandle) and topk_idx None, routes x along that
        earlier dispatch (a cached dispatch, as combine's backward uses); topk_weights, if
        given, then pass through unmasked.
        """
        with self._round("dispatch"):
            self._tensors("normal_dispatch", x=x)
            self._tensors("normal_dispatch", optional=True, topk_idx=topk_idx,
                          topk_weights=topk_weights)
            if handle is not None and topk_idx is None:
                in_rank, E = handle.is_token_in_rank, handle.num_experts
            else:
                in_rank, E = None, int(num_experts)
            align = int(expert_alignment)
        recv_x, recv_topk, recv_w, per_expert, recv_src, counts, in_rank = self._native(
            "dispatch", self._impl.normal_dispatch, x, topk_idx, topk_weights, E, align,
            in_rank)
        h = NormalHandle(in_rank, counts, recv_src, recv_topk, recv_w, E)
        return recv_x, recv_topk, recv_w, per_expert, h

    def normal_combine(self, y, handle, topk_weights=None):
        """Sums, for every token this rank dispatched, the rows of every rank that received
        it (no weights; float32 in ascending rank order, rounded once).

        Returns (out [T, H], out_topk_weights [T, K]): the received weights (the handle's, or
        `topk_weights` [N, K]) summed the same way; None when there are none.
        """
        with self._round("combine"):
            self._tensors("normal_combine", y=y)
            self._tensors("normal_combine", optional=True, topk_weights=topk_weights)
            w = handle.recv_topk_weights if topk_weights is None else topk_weights
            counts, in_rank = handle.recv_counts, handle.is_token_in_rank
        return self._native("combine", self._impl.normal_combine, y, counts, in_rank, w)

    def _tensors(self, call, optional=False, **named):
        """TypeError (naming this rank, the call and the argument) for an argument that is not
        a tensor (or None, where `optional`); raised inside _round, so the round is given up."""
        for name, v in named.items():
            if not (isinstance(v, torch.Tensor) or (optional and v is None)):
                raise TypeError(f"rank {self.rank}: {call}: {name} must be a torch.Tensor"
                                f"{' or None' if optional else ''}, not {type(v).__name__}")

    def _native(self, kind, fn, *args):
        """The native dispatch/combine call. An argument of a type it does not take (a list or
        None where a tensor goes) is refused by the binding before the call takes its round:
        the round is given up then, as for any error before the call, and the TypeError names
        this rank and the call. (Before, the other ranks' calls of that round ended without
        this rank's data and every later round paired different calls, silently.)"""
        try:
            return fn(*args)
        except TypeError as e:
            if "incompatible function arguments" not in str(e):
                raise
            if not isinstance(self._impl, _Disconnected):
                self._impl.abandon(kind)
            raise TypeError(f"rank {self.rank}: {kind}: an argument of the wrong type "
                            f"(tensors expected): {e}") from None

    @contextlib.contextmanager
    def _round(self, kind):
        """Argument preparation of a dispatch/combine: an error here (before the native call)
        still gives the round up, so the peers' calls of that round end at once with an error
        naming this rank and the next round is in step on every rank."""
        try:
            yield
        except Exception:
            if not isinstance(self._impl, _Disconnected):
                self._impl.abandon(kind)
            raise


class _Disconnected:
    """What a Buffer calls while update_ep_member runs or after it failed."""

    def __init__(self, rank, why):
        self._why = f"ep.Buffer (rank {rank}): not connected: {why}"

    def __getattr__(self, name):
        raise RuntimeError(self._why)


# ---- autograd (normal mode): backward of dispatch is combine and vice versa ----

class _NormalDispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, expert_alignment, box):
        recv_x, recv_topk, recv_w, per_expert, handle = buffer.normal_dispatch(
            x, topk_idx, topk_weights, num_experts, expert_alignment)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.has_weights = topk_weights is not None
        ctx.shape_x, ctx.dtype_x = x.shape, x.dtype
        box.append(handle)
        outs = [recv_x, recv_topk, recv_w, per_expert]
        ctx.mark_non_differentiable(*[t for t in (recv_topk, per_expert) if t is not None])
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_recv_x, _g_topk, grad_recv_w, _g_per_expert):
        h = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros((h.recv_src_idx.numel(), ctx.shape_x[1]), dtype=ctx.dtype_x)
        w = None
        if ctx.has_weights:
            if grad_recv_w is None:
                grad_recv_w = torch.zeros_like(h.recv_topk_weights)
            # The weights of other ranks' experts were the constant 0: no gradient.
            w = grad_recv_w * (h.recv_topk_idx >= 0).to(grad_recv_w.dtype)
            w = w.contiguous()
        grad_x, grad_w = ctx.buffer.normal_combine(grad_recv_x.contiguous(), h, topk_weights=w)
        if not ctx.has_weights:
            grad_w = None
        return grad_x, grad_w, None, None, None, None, None


class _NormalCombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, recv_topk_weights, buffer, handle):
        out, out_w = buffer.normal_combine(y, handle, topk_weights=recv_topk_weights)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.has_weights = recv_topk_weights is not None
        ctx.y_dtype, ctx.hidden = y.dtype, y.shape[1]
        return out, out_w

    @staticmethod
    def backward(ctx, grad_out, grad_out_w):
        h = ctx.handle
        T = h.is_token_in_rank.shape[0]
        if grad_out is None:
            grad_out = torch.zeros((T, ctx.hidden), dtype=ctx.y_dtype)
        w = None
        if ctx.has_weights:
            w = grad_out_w if grad_out_w is not None else torch.zeros(
                (T, h.recv_topk_weights.shape[1]), dtype=torch.float32)
            w = w.contiguous()
        grad_y, _, grad_w, _, _ = ctx.buffer.normal_dispatch(
            grad_out.contiguous(), None, w, h.num_experts, handle=h)
        return grad_y, (grad_w if ctx.has_weights else None), None, None


def dispatch_autograd(buffer, x, topk_idx, topk_weights, num_experts, expert_alignment=1):
    """normal_dispatch with autograd: returns (recv_x, recv_topk_idx, recv_topk_weights,
    num_recv_per_expert, handle); gradients of recv_x / recv_topk_weights flow back to x /
    topk_weights through normal_combine."""
    box = []
    recv_x, recv_topk, recv_w, per_expert = _NormalDispatchFn.apply(
        x, topk_weights, buffer, topk_idx, num_experts, expert_alignment, box)
    return recv_x, recv_topk, recv_w, per_expert, box[0]


def combine_autograd(buffer, y, handle, recv_topk_weights=None):
    """normal_combine with autograd: returns (out, out_topk_weights); the gradient of out
    flows back to y (and of out_topk_weights to recv_topk_weights) through a cached
    normal_dispatch along the handle's routes."""
    if recv_topk_weights is None:
        recv_topk_weights = handle.recv_topk_weights
    return _NormalCombineFn.apply(y, recv_topk_weights, buffer, handle)
