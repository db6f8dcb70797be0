"""The serving half of the demo (scripts/demo_torch.py runs it after the collectives):
KV-cache offload through mooncake.store and one MoE dispatch/combine round through
mooncake.ep, both on the engine and registered memory of the job's mooncake process group.

KV offload, as a serving deployment uses it: two requests share a long system prompt.

* rank 0 serves request 1: prefills it (time to first token, cold), then offloads the KV of
  every full 512-token block into the store, into its own segment, under prefix-hash keys
  (the FAST'25 traces' block scheme: a block's key hashes its tokens and its whole prefix, so
  equal keys mean equal KV);
* rank 1 serves request 2 (same system prompt, another question) twice: once by a full
  prefill, once by looking up its blocks' keys, reading the leading ones that exist straight
  into its registered KV cache (from rank 0's memory, through the engine) and prefilling only
  the rest. It prints both TTFTs and checks that the logits agree.

The model is a small decoder-only transformer in plain torch (random weights, fixed seed, the
same on both ranks; RoPE positions, so reused KV is only valid at the same positions, which
the prefix keys guarantee). KV is kept in float32 so that the logits can be compared tightly.
"""

import hashlib
import time

import torch
import torch.distributed as dist

BLOCK_TOKENS = 512  # the FAST'25 traces' block


class TinyLM:
    """Decoder-only transformer: RMSNorm, RoPE attention, SiLU MLP, tied embeddings."""

    # Small enough that a 1k-token prefill takes about a second on one core of this 2-core
    # box (Debian's torch uses the reference BLAS); the point is the ratio of the two TTFTs.
    def __init__(self, vocab=4096, d=128, heads=2, layers=4, ffn=512, seed=1234):
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale):
            return torch.randn(*shape, generator=g) * scale

        self.vocab, self.d, self.heads, self.layers = vocab, d, heads, layers
        self.hd = d // heads
        self.emb = w(vocab, d, scale=1.0)
        self.blocks = [{
            "wq": w(d, d, scale=d ** -0.5), "wk": w(d, d, scale=d ** -0.5),
            "wv": w(d, d, scale=d ** -0.5), "wo": w(d, d, scale=d ** -0.5),
            "w1": w(d, ffn, scale=d ** -0.5), "w2": w(ffn, d, scale=ffn ** -0.5),
        } for _ in range(layers)]
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        self.inv_freq = inv

    def kv_block_shape(self):
        """One block of cached KV: [layers, K/V, tokens, heads, head_dim]."""
        return (self.layers, 2, BLOCK_TOKENS, self.heads, self.hd)

    @staticmethod
    def _norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _rope(self, x, pos):
        ang = pos[:, None].float() * self.inv_freq[None, :]        # [T, hd/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]    # [T, 1, hd/2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    @torch.no_grad()
    def prefill(self, tokens, past=None):
        """Runs `tokens` after `past` (per layer (K, V) [P, heads, hd], or None). Returns the
        logits of the last position and this call's per-layer (K, V)."""
        P = 0 if past is None else past[0][0].shape[0]
        T = tokens.numel()
        pos = torch.arange(P, P + T)
        x = self.emb[tokens]
        mask = torch.ones(T, P + T, dtype=torch.bool).triu(P + 1)  # key after query: masked
        new_kv = []
        for li, b in enumerate(self.blocks):
            h = self._norm(x)
            q = self._rope((h @ b["wq"]).view(T, self.heads, self.hd), pos)
            k = self._rope((h @ b["wk"]).view(T, self.heads, self.hd), pos)
            v = (h @ b["wv"]).view(T, self.heads, self.hd)
            new_kv.append((k, v))
            if past is not None:
                k = torch.cat([past[li][0], k])
                v = torch.cat([past[li][1], v])
            # [heads, T, P+T] scores by batched matmul over heads
            s = torch.bmm(q.transpose(0, 1), k.permute(1, 2, 0)) * (self.hd ** -0.5)
            s.masked_fill_(mask, float("-inf"))
            a = torch.bmm(s.softmax(-1), v.transpose(0, 1)).transpose(0, 1).reshape(T, self.d)
            x = x + a @ b["wo"]
            x = x + torch.nn.functional.silu(self._norm(x) @ b["w1"]) @ b["w2"]
        logits = self._norm(x[-1]) @ self.emb.t()
        return logits, new_kv


def block_keys(tokens, namespace="demo"):
    """Prefix-hash keys of the full blocks of `tokens`: key i hashes block i's tokens and
    key i-1, so it names the whole prefix (the partial last block is not cached)."""
    keys, prev = [], b""
    for i in range(tokens.numel() // BLOCK_TOKENS):
        blk = tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS].to(torch.int32).numpy().tobytes()
        prev = hashlib.sha256(prev + blk).digest()
        keys.append(f"{namespace}/kv/{prev.hex()[:32]}")
    return keys


class PagedKV:
    """A serving process's KV cache: [blocks, layers, 2, BLOCK_TOKENS, heads, hd], allocated
    once and registered with the store once, so offload and reload move bytes straight
    between it and the store's segments."""

    def __init__(self, store, model, num_blocks):
        self.t = torch.zeros((num_blocks,) + model.kv_block_shape())
        self.block_bytes = self.t[0].numel() * self.t.element_size()
        rc = store.register_buffer(self.t.data_ptr(), self.t.numel() * self.t.element_size())
        if rc != 0:
            raise RuntimeError(f"register_buffer failed: {rc}")
        self.store = store

    def ptr(self, i):
        return self.t[i].data_ptr()

    def write(self, kv, n_blocks):
        """Copies the first n_blocks blocks of per-layer (K, V) into the cache."""
        for li, (k, v) in enumerate(kv):
            n = n_blocks * BLOCK_TOKENS
            self.t[:n_blocks, li, 0] = k[:n].reshape(n_blocks, BLOCK_TOKENS, *k.shape[1:])
            self.t[:n_blocks, li, 1] = v[:n].reshape(n_blocks, BLOCK_TOKENS, *v.shape[1:])

    def past(self, n_blocks):
        """Per-layer (K, V) [n_blocks * BLOCK_TOKENS, heads, hd] of the first n_blocks."""
        n = n_blocks * BLOCK_TOKENS
        out = []
        for li in range(self.t.shape[1]):
            k = self.t[:n_blocks, li, 0].reshape(n, *self.t.shape[4:])
            v = self.t[:n_blocks, li, 1].reshape(n, *self.t.shape[4:])
            out.append((k, v))
        return out

    def close(self):
        self.store.unregister_buffer(self.t.data_ptr())


def _best_of(n, fn):
    best, out = None, None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def kv_offload(rank, world, gloo, system_tokens=1024):
    """Returns (ok, lines to print on rank 0)."""
    from mooncake.store import ReplicateConfig, Store

    model = TinyLM()
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, model.vocab, (system_tokens,), generator=g)
    question = [torch.randint(0, model.vocab, (n,), generator=g) for n in (100, 120)]
    req = [torch.cat([system, q]) for q in question]
    max_blocks = max(r.numel() for r in req) // BLOCK_TOKENS

    # Every rank lends 64 MiB of its group engine's memory; the master runs on rank 0.
    store = Store.from_group(segment_size=64 << 20)
    cache = PagedKV(store, model, max_blocks)
    model.prefill(req[0][:64])  # warm-up (allocator, kernels)
    info = {}
    ok = True

    if rank == 0:
        keys = block_keys(req[0])
        ttft, (logits, kv) = _best_of(1, lambda: model.prefill(req[0]))
        cfg = ReplicateConfig()
        cfg.preferred_segment = store.get_hostname()  # this rank's own memory
        t0 = time.perf_counter()
        cache.write(kv, len(keys))
        rcs = store.batch_put_from(keys, [cache.ptr(i) for i in range(len(keys))],
                                   [cache.block_bytes] * len(keys), cfg)
        put_s = time.perf_counter() - t0
        ok = all(rc == 0 for rc in rcs)
        info = {"ttft": ttft, "tokens": req[0].numel(), "blocks": len(keys), "put_s": put_s,
                "rcs": rcs, "block_bytes": cache.block_bytes}
    # Waits of seconds go through the gloo group: a blocking wait, no spinning on a core
    # that the other rank's prefill needs (this box may have two).
    dist.barrier(group=gloo)

    if rank == 1 % world:
        r = req[1]
        ttft_cold, (ref_logits, _) = _best_of(1, lambda: model.prefill(r))

        def with_cache():
            keys = block_keys(r)
            exist = store.batch_is_exist(keys)
            n = 0
            while n < len(keys) and exist[n] == 1:
                n += 1
            t0 = time.perf_counter()
            got = store.batch_get_into(keys[:n], [cache.ptr(i) for i in range(n)],
                                       [cache.block_bytes] * n)
            get_s = time.perf_counter() - t0
            if any(x != cache.block_bytes for x in got):
                raise RuntimeError(f"batch_get_into returned {got}")
            logits, _ = model.prefill(r[n * BLOCK_TOKENS:], past=cache.past(n))
            return logits, n, get_s

        ttft_cache, (logits, n, get_s) = _best_of(3, with_cache)
        diff = float((logits - ref_logits).abs().max())
        same_next = int(logits.argmax()) == int(ref_logits.argmax())
        match = torch.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4) and same_next
        ok = match and n == len(block_keys(r))
        info = {"ttft_cold": ttft_cold, "ttft_cache": ttft_cache, "n": n, "get_s": get_s,
                "tokens": r.numel(), "diff": diff, "next": int(ref_logits.argmax()),
                "match": match, "suffix": r.numel() - n * BLOCK_TOKENS}
    dist.barrier(group=gloo)
    infos = [None] * world
    dist.all_gather_object(infos, info, group=gloo)
    cache.close()
    store.close()

    lines = []
    if rank == 0:
        a, b = infos[0], infos[1 % world]
        mib = a["block_bytes"] / (1 << 20)
        lines.append(f"model: {model.layers} layers, d_model {model.d}, {model.heads} heads, "
                     f"random weights; KV {mib:.0f} MiB per {BLOCK_TOKENS}-token block "
                     "(float32)")
        lines.append(f"request 1 on rank 0: {a['tokens']} tokens, TTFT {a['ttft'] * 1e3:.0f} ms; "
                     f"offloaded {a['blocks']} blocks ({a['blocks'] * mib:.0f} MiB) into rank 0's "
                     f"segment under prefix-hash keys in {a['put_s'] * 1e3:.1f} ms "
                     f"(put codes {a['rcs']})")
        lines.append(f"request 2 on rank {1 % world}: the same {system_tokens}-token system "
                     f"prompt + another question, {b['tokens']} tokens")
        lines.append(f"  without cache: TTFT {b['ttft_cold'] * 1e3:8.1f} ms (full prefill)")
        lines.append(f"  with cache:    TTFT {b['ttft_cache'] * 1e3:8.1f} ms, best of 3: "
                     f"{b['n']} blocks = {b['n'] * BLOCK_TOKENS} tokens read from rank 0's "
                     f"memory in {b['get_s'] * 1e3:.1f} ms, {b['suffix']} tokens prefilled "
                     f"({b['ttft_cold'] / b['ttft_cache']:.0f}x faster)")
        lines.append(f"  logits {'match' if b['match'] else 'DIFFER FROM'} the full prefill "
                     f"(max |diff| {b['diff']:.1e}; next token {b['next']})")
    oks = [None] * world
    dist.all_gather_object(oks, ok, group=gloo)
    return all(oks), lines


def ep_round(rank, world, gloo, tokens=64, hidden=256, experts_per_rank=4, topk=2):
    """One low-latency dispatch/combine round; every rank checks its combined output against
    a local reference (each expert e scales its rows by 1 + e/16)."""
    from mooncake.ep import Buffer

    E = experts_per_rank * world
    L = experts_per_rank
    buf = Buffer(dist.group.WORLD,
                 Buffer.get_ep_buffer_size_hint(tokens, hidden, world, E))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=g)
    active = torch.ones(world, dtype=torch.int32)
    dist.barrier()
    t0 = time.perf_counter()
    recv_x, recv_count, handle, _, _ = buf.dispatch(x, topk_idx, active, tokens, E)
    t1 = time.perf_counter()
    y = torch.zeros_like(recv_x)
    for l in range(L):
        n = int(recv_count[l])
        y[l, :n] = recv_x[l, :n] * (1.0 + (rank * L + l) / 16.0)
    t2 = time.perf_counter()
    out, _, _ = buf.combine(y, topk_idx, w, active, None, handle)
    t3 = time.perf_counter()
    ref = ((w * (1.0 + topk_idx.float() / 16.0)).sum(1, keepdim=True)) * x
    diff = float((out - ref).abs().max())
    ok = torch.allclose(out, ref, rtol=1e-5, atol=1e-5) and bool(active.all())
    res = [None] * world
    dist.all_gather_object(res, (ok, diff, int(recv_count.sum()), t1 - t0, t3 - t2), group=gloo)
    lines = []
    if rank == 0:
        worst = max(r[1] for r in res)
        lines.append(f"{world} ranks x {tokens} tokens x {hidden} hidden, {E} experts "
                     f"({L} per rank), top-{topk}: rows received per rank "
                     f"{[r[2] for r in res]}; dispatch {res[0][3] * 1e3:.2f} ms, combine "
                     f"{res[0][4] * 1e3:.2f} ms on rank 0")
        lines.append(f"  combined outputs {'match' if all(r[0] for r in res) else 'DIFFER FROM'} "
                     f"the local reference on every rank (max |diff| {worst:.1e})")
    return all(r[0] for r in res), lines
