"""``mooncake-kv-size``: how big a model's KV cache is, and how much of it fits.

    mooncake-kv-size --model llama-3-70b                      # built-in table
    mooncake-kv-size --model /path/to/config.json --dtype fp8 --tp 8
    mooncake-kv-size --model deepseek-v3 --capacity 64GiB --request-tokens 16384 --json

Per token, every attention layer caches:

* MHA / GQA / MQA: K and V for each KV head: ``2 * num_key_value_heads * head_dim`` elements
  (MQA is the case of one KV head, GQA of fewer KV heads than query heads);
* MLA (DeepSeek-V2/V3): one compressed latent per token, shared by all heads, with no separate
  K and V: ``kv_lora_rank + qk_rope_head_dim`` elements (what vLLM and SGLang cache).

times ``num_hidden_layers`` layers, times the cache dtype's size. Under tensor parallelism the
KV heads are split over the ranks (vLLM's rule: ``max(1, kv_heads // tp)`` heads per rank, so
with tp > kv_heads every rank keeps a replica of one head); an MLA latent is not split, every
rank caches all of it. ``bytes_per_token`` is the model's KV for one token (all layers, each
head once); ``*_per_rank`` is what one rank holds; ``*_all_ranks`` is the sum over the tp ranks,
replicas included (the MLA latent tp times, replicated KV heads as often as they are held).

``--capacity`` answers three ways: ``fit`` counts the model's KV once (a store that keeps one
copy of every block), ``fit_per_rank`` takes the capacity as one rank's memory, and
``fit_all_ranks`` (printed when tp > 1) counts every rank's copy (a store that keeps each
rank's blocks under their own keys, replicas included).

Not modelled: sliding-window layers (counted as full layers: an upper bound), hybrid
linear-attention / state-space layers, extra multi-token-prediction layers, and the
per-block metadata of a serving engine.
"""

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass

DTYPE_BYTES = {
    "fp32": 4, "float32": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
DTYPE_CANON = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
               "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}

DEFAULT_BLOCK_TOKENS = 512  # Mooncake's FAST'25 traces: one hash id = 512 tokens


@dataclass(frozen=True)
class KVShape:
    """What one token of a model leaves in the KV cache."""

    name: str
    layers: int
    attention: str          # "MHA", "GQA", "MQA" or "MLA"
    query_heads: int = 0
    kv_heads: int = 0       # MHA/GQA/MQA
    head_dim: int = 0       # MHA/GQA/MQA
    kv_lora_rank: int = 0   # MLA
    rope_dim: int = 0       # MLA: qk_rope_head_dim
    source: str = ""

    def elements_per_layer(self, tp=1):
        """Cached elements per token and layer on one rank of ``tp``."""
        if self.attention == "MLA":
            return self.kv_lora_rank + self.rope_dim
        return 2 * kv_heads_per_rank(self.kv_heads, tp) * self.head_dim


def _attention_kind(query_heads, kv_heads):
    if kv_heads == query_heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else "GQA"


def _gqa(name, layers, query_heads, kv_heads, head_dim, source):
    return KVShape(name=name, layers=layers, attention=_attention_kind(query_heads, kv_heads),
                   query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim, source=source)


# Built-in table. Every row is the published config.json of the model on Hugging Face
# (values quoted in the comment; head_dim = hidden_size / num_attention_heads where the config
# has no head_dim).
MODELS = {
    # meta-llama/Meta-Llama-3-8B: num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, hidden_size 4096 -> head_dim 128.
    "llama-3-8b": _gqa("llama-3-8b", 32, 32, 8, 128, "meta-llama/Meta-Llama-3-8B"),
    # meta-llama/Meta-Llama-3-70B: num_hidden_layers 80, num_attention_heads 64,
    # num_key_value_heads 8, hidden_size 8192 -> head_dim 128.
    "llama-3-70b": _gqa("llama-3-70b", 80, 64, 8, 128, "meta-llama/Meta-Llama-3-70B"),
    # meta-llama/Llama-3.1-405B: num_hidden_layers 126, num_attention_heads 128,
    # num_key_value_heads 8, head_dim 128 (hidden_size 16384). The first upload said 16 KV
    # heads; the current config and the Llama 3 paper (8 KV heads) agree on 8.
    "llama-3.1-405b": _gqa("llama-3.1-405b", 126, 128, 8, 128, "meta-llama/Llama-3.1-405B"),
    # Qwen/Qwen2.5-7B: num_hidden_layers 28, num_attention_heads 28, num_key_value_heads 4,
    # hidden_size 3584 -> head_dim 128.
    "qwen2.5-7b": _gqa("qwen2.5-7b", 28, 28, 4, 128, "Qwen/Qwen2.5-7B"),
    # Qwen/Qwen2.5-72B: num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8,
    # hidden_size 8192 -> head_dim 128.
    "qwen2.5-72b": _gqa("qwen2.5-72b", 80, 64, 8, 128, "Qwen/Qwen2.5-72B"),
    # Qwen/Qwen3-8B: num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8,
    # head_dim 128.
    "qwen3-8b": _gqa("qwen3-8b", 36, 32, 8, 128, "Qwen/Qwen3-8B"),
    # Qwen/Qwen3-32B: num_hidden_layers 64, num_attention_heads 64, num_key_value_heads 8,
    # head_dim 128 (not hidden_size 5120 / 64 = 80: Qwen3 sets head_dim explicitly).
    "qwen3-32b": _gqa("qwen3-32b", 64, 64, 8, 128, "Qwen/Qwen3-32B"),
    # Qwen/Qwen3-235B-A22B: num_hidden_layers 94, num_attention_heads 64,
    # num_key_value_heads 4, head_dim 128.
    "qwen3-235b-a22b": _gqa("qwen3-235b-a22b", 94, 64, 4, 128, "Qwen/Qwen3-235B-A22B"),
    # mistralai/Mixtral-8x7B-v0.1: num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, hidden_size 4096 -> head_dim 128. (The experts are in the MLP;
    # attention, and so the KV cache, is that of a dense 7B.)
    "mixtral-8x7b": _gqa("mixtral-8x7b", 32, 32, 8, 128, "mistralai/Mixtral-8x7B-v0.1"),
    # tiiuae/falcon-7b: n_layer 32, n_head 71, hidden_size 4544 -> head_dim 64,
    # multi_query true -> one KV head (MQA).
    "falcon-7b": _gqa("falcon-7b", 32, 71, 1, 64, "tiiuae/falcon-7b"),
    # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64
    # (num_attention_heads 128). MLA caches the 512-wide compressed KV latent plus the 64-wide
    # decoupled RoPE key per token and layer; K and V are re-expanded from it.
    "deepseek-v3": KVShape(name="deepseek-v3", layers=61, attention="MLA", query_heads=128,
                           kv_lora_rank=512, rope_dim=64, source="deepseek-ai/DeepSeek-V3"),
}
# Other spellings: normalised (lower case, alphanumerics only, "meta" prefix and
# "instruct"/"chat"/"base" suffixes dropped) -> table key.
ALIASES = {
    "llama38b": "llama-3-8b", "llama318b": "llama-3-8b",
    "llama370b": "llama-3-70b", "llama3170b": "llama-3-70b", "llama3370b": "llama-3-70b",
    "llama31405b": "llama-3.1-405b", "llama3405b": "llama-3.1-405b",
    "qwen257b": "qwen2.5-7b", "qwen2572b": "qwen2.5-72b",
    "qwen38b": "qwen3-8b", "qwen332b": "qwen3-32b",
    "qwen3235ba22b": "qwen3-235b-a22b", "qwen3235b": "qwen3-235b-a22b",
    "mixtral8x7b": "mixtral-8x7b", "mixtral8x7bv01": "mixtral-8x7b",
    "falcon7b": "falcon-7b",
    "deepseekv3": "deepseek-v3", "deepseekr1": "deepseek-v3",
}


def _normalise(name):
    n = re.sub(r"[^a-z0-9]", "", name.lower().rsplit("/", 1)[-1])
    n = re.sub(r"^meta", "", n)
    n = re.sub(r"(instruct|chat|base|hf)$", "", n)
    return n


def kv_heads_per_rank(kv_heads, tp):
    """KV heads one tensor-parallel rank holds (vLLM's ``get_num_kv_heads``): the heads are
    split evenly; with more ranks than heads each rank keeps one (replicated) head."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if kv_heads >= tp:
        if kv_heads % tp:
            raise ValueError(f"{kv_heads} KV heads cannot be split evenly over tp={tp}")
    elif tp % kv_heads:
        raise ValueError(f"tp={tp} is not a multiple of the {kv_heads} KV heads")
    return max(1, kv_heads // tp)


def shape_from_config(cfg, name="config.json"):
    """KVShape from a Hugging Face config.json (a dict)."""
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM inside
        cfg = dict(cfg["text_config"], **{k: v for k, v in cfg.items() if k != "text_config"
                                          and k not in cfg["text_config"]})

    def first(*keys):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        return None

    layers = first("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    if not layers:
        raise ValueError(f"{name}: no num_hidden_layers")
    qheads = first("num_attention_heads", "n_head", "n_heads")
    if cfg.get("kv_lora_rank"):
        return KVShape(name=name, layers=int(layers), attention="MLA",
                       query_heads=int(qheads or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                       rope_dim=int(cfg.get("qk_rope_head_dim") or 0), source=name)
    if not qheads:
        raise ValueError(f"{name}: no num_attention_heads")
    qheads = int(qheads)
    mt = str(cfg.get("model_type", "")).lower()
    if mt in ("falcon", "refinedweb", "refinedwebmodel"):
        # Falcon: num_kv_heads counts only with new_decoder_architecture; otherwise
        # multi_query means one shared KV head (HF FalconAttention).
        if cfg.get("new_decoder_architecture"):
            kv = int(first("num_kv_heads", "n_head_kv") or qheads)
        else:
            kv = 1 if cfg.get("multi_query", True) else qheads
    elif cfg.get("multi_query") is True:  # gpt_bigcode (StarCoder) and similar
        kv = 1
    else:
        kv = int(first("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
                 or qheads)
    head_dim = first("head_dim", "kv_channels")
    if not head_dim:
        hidden = first("hidden_size", "n_embd", "d_model")
        if not hidden:
            raise ValueError(f"{name}: neither head_dim nor hidden_size")
        head_dim = int(hidden) // qheads
    return _gqa(name, int(layers), qheads, kv, int(head_dim), name)


def lookup(model):
    """KVShape for a table name/alias, a config.json path or a directory holding one."""
    if os.path.isdir(model):
        model = os.path.join(model, "config.json")
    if os.path.isfile(model):
        with open(model, encoding="utf-8") as f:
            return shape_from_config(json.load(f), name=model)
    key = model.lower()
    if key not in MODELS:
        key = ALIASES.get(_normalise(model), key)
    if key not in MODELS:
        raise KeyError(f"unknown model {model!r} (not a file either); built in: "
                       f"{', '.join(MODELS)}; or pass a config.json")
    return MODELS[key]


def dtype_bytes(dtype):
    d = dtype.lower()
    if d not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; one of fp32, fp16, bf16, fp8")
    return DTYPE_BYTES[d]


_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
          "p": 1 << 50, "pib": 1 << 50, "pb": 10**15}


def parse_bytes(text):
    """'64GiB' -> 68719476736. KiB/MiB/GiB/TiB (and bare K/M/G/T) are powers of 1024;
    KB/MB/GB/TB powers of 1000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 64GiB, 500GB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.2f} {unit}"
        n /= 1024


def kv_size(shape, dtype="bf16", tp=1, block_tokens=DEFAULT_BLOCK_TOKENS, request_tokens=None,
            tokens=None, capacity_bytes=None):
    """Every number the tool prints, as a dict (the --json object)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    b = dtype_bytes(dtype)
    per_token = shape.layers * shape.elements_per_layer(1) * b
    per_rank = shape.layers * shape.elements_per_layer(tp) * b
    all_ranks = per_rank * tp
    out = {
        "model": shape.name,
        "source": shape.source,
        "attention": shape.attention,
        "layers": shape.layers,
        "query_heads": shape.query_heads,
        "kv_heads": shape.kv_heads if shape.attention != "MLA" else None,
        "head_dim": shape.head_dim if shape.attention != "MLA" else None,
        "kv_lora_rank": shape.kv_lora_rank if shape.attention == "MLA" else None,
        "qk_rope_head_dim": shape.rope_dim if shape.attention == "MLA" else None,
        "elements_per_token_per_layer": shape.elements_per_layer(1),
        "dtype": DTYPE_CANON.get(dtype.lower(), dtype.lower()),
        "dtype_bytes": b,
        "tp": tp,
        "kv_heads_per_rank": (kv_heads_per_rank(shape.kv_heads, tp)
                              if shape.attention != "MLA" else None),
        "block_tokens": block_tokens,
        "bytes_per_token": per_token,
        "bytes_per_token_per_rank": per_rank,
        "bytes_per_token_all_ranks": all_ranks,
        "bytes_per_block": per_token * block_tokens,
        "bytes_per_block_per_rank": per_rank * block_tokens,
        "bytes_per_block_all_ranks": all_ranks * block_tokens,
    }
    if tokens is not None:
        out["tokens"] = tokens
        out["bytes_for_tokens"] = per_token * tokens
        out["bytes_for_tokens_all_ranks"] = all_ranks * tokens
    if request_tokens is not None:
        blocks = math.ceil(request_tokens / block_tokens)
        out["request_tokens"] = request_tokens
        out["bytes_per_request"] = per_token * request_tokens
        out["blocks_per_request"] = blocks
        out["bytes_per_request_in_blocks"] = blocks * per_token * block_tokens
    if capacity_bytes is not None:
        out["capacity_bytes"] = capacity_bytes

        def fits(unit_bytes):
            f = {"tokens": capacity_bytes // unit_bytes,
                 "blocks": capacity_bytes // (unit_bytes * block_tokens)}
            if request_tokens is not None:
                f["requests"] = f["blocks"] // math.ceil(request_tokens / block_tokens)
            return f

        out["fit"] = fits(per_token)
        out["fit_per_rank"] = fits(per_rank)
        if tp > 1:
            out["fit_all_ranks"] = fits(all_ranks)
    return out


def blocks_for_capacity(capacity_bytes, model, dtype="bf16", tp=1,
                        block_tokens=DEFAULT_BLOCK_TOKENS):
    """(blocks, bytes per block): how many whole blocks of the model's KV (each head once)
    a store of capacity_bytes holds."""
    r = kv_size(lookup(model), dtype=dtype, tp=tp, block_tokens=block_tokens,
                capacity_bytes=capacity_bytes)
    return r["fit"]["blocks"], r["bytes_per_block"]


def format_text(r):
    def bytes_line(n):
        return f"{human(n)} ({n:,} B)"

    lines = [f"model       {r['model']}" + (f"  ({r['source']})" if r["source"] != r["model"]
                                              else "")]
    if r["attention"] == "MLA":
        lines.append(f"attention   MLA: {r['layers']} layers x (kv_lora_rank {r['kv_lora_rank']} + "
                     f"qk_rope_head_dim {r['qk_rope_head_dim']}) latent, no separate K and V")
    else:
        lines.append(f"attention   {r['attention']}: {r['layers']} layers x {r['kv_heads']} KV "
                     f"heads x {r['head_dim']} head_dim x 2 (K and V)")
    lines.append(f"dtype       {r['dtype']} ({r['dtype_bytes']} B)")
    lines.append(f"per token   {bytes_line(r['bytes_per_token'])}")
    if r["tp"] > 1:
        what = ("the whole latent on every rank" if r["attention"] == "MLA"
                else f"{r['kv_heads_per_rank']} KV heads per rank")
        lines.append(f"  tp={r['tp']}    per rank {bytes_line(r['bytes_per_token_per_rank'])}, "
                     f"all ranks {bytes_line(r['bytes_per_token_all_ranks'])} ({what})")
    lines.append(f"per block   {bytes_line(r['bytes_per_block'])} "
                 f"({r['block_tokens']} tokens)")
    if r["tp"] > 1:
        lines.append(f"  tp={r['tp']}    per rank {bytes_line(r['bytes_per_block_per_rank'])}, "
                     f"all ranks {bytes_line(r['bytes_per_block_all_ranks'])}")
    if "tokens" in r:
        lines.append(f"{r['tokens']:,} tokens  {bytes_line(r['bytes_for_tokens'])}")
    if "request_tokens" in r:
        lines.append(f"per request {bytes_line(r['bytes_per_request'])} "
                     f"({r['request_tokens']:,} tokens, {r['blocks_per_request']} blocks)")
    if "capacity_bytes" in r:
        f = r["fit"]
        fit = f"{f['tokens']:,} tokens = {f['blocks']:,} blocks"
        if "requests" in f:
            fit += f" = {f['requests']:,} requests"
        lines.append(f"{human(r['capacity_bytes'])} holds {fit}")
        if r["tp"] > 1:
            for key, what in (("fit_per_rank", "as one rank's memory"),
                              ("fit_all_ranks", "keeping every rank's copy")):
                f = r[key]
                lines.append(f"  {what}: {f['tokens']:,} tokens = {f['blocks']:,} blocks"
                             + (f" = {f['requests']:,} requests" if "requests" in f else ""))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="mooncake-kv-size",
        description="KV-cache bytes per token, block and request, and what fits in a capacity.")
    ap.add_argument("--model", "-m", help="built-in model name, or a Hugging Face config.json "
                    "(or a directory holding one)")
    ap.add_argument("--config", help="a config.json (same as --model PATH)")
    ap.add_argument("--dtype", default="bf16", help="KV-cache dtype: bf16 (default), fp16, fp8, "
                    "fp32")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    ap.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                    help="tokens per block (default 512, the FAST'25 traces' block)")
    ap.add_argument("--tokens", type=int, help="also print the bytes of this many tokens")
    ap.add_argument("--request-tokens", type=int,
                    help="tokens per request (prompt + output) for per-request figures")
    ap.add_argument("--capacity", help="how much fits in this many bytes (e.g. 64GiB, 500GB)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--list", action="store_true", help="list the built-in models")
    a = ap.parse_args(argv)

    if a.list:
        for k, s in MODELS.items():
            r = kv_size(s, dtype=a.dtype, block_tokens=a.block_tokens)
            print(f"{k:18} {s.attention:4} {human(r['bytes_per_token']):>12}/token  "
                  f"({s.source})")
        return 0
    model = a.config or a.model
    if not model:
        ap.error("give --model NAME|config.json (or --list)")
    try:
        shape = lookup(model)
        cap = parse_bytes(a.capacity) if a.capacity is not None else None
        r = kv_size(shape, dtype=a.dtype, tp=a.tp, block_tokens=a.block_tokens,
                    request_tokens=a.request_tokens, tokens=a.tokens, capacity_bytes=cap)
    except (KeyError, ValueError) as e:
        print(f"mooncake-kv-size: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if a.json else format_text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
