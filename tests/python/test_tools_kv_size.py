"""mooncake-kv-size against hand-computed values.

Per token, a layer caches 2 (K and V) x KV heads x head_dim elements (MHA/GQA/MQA), or one
kv_lora_rank + qk_rope_head_dim latent (MLA); times layers, times the dtype's bytes. The
arithmetic of every expected value is written next to it.
"""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

kv = pytest.importorskip("mooncake.tools.kv_size")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def size(model, **kw):
    return kv.kv_size(kv.lookup(model), **kw)


def test_llama3_70b_bf16_is_320_kib_per_token():
    r = size("llama-3-70b", dtype="bf16")
    # 80 layers * 8 KV heads * 128 head_dim * 2 (K, V) * 2 bytes = 327,680 B = 320 KiB
    assert r["bytes_per_token"] == 80 * 8 * 128 * 2 * 2 == 327_680 == 320 * KiB
    # one 512-token block (the FAST'25 traces' block): 327,680 * 512 = 167,772,160 B = 160 MiB
    assert r["bytes_per_block"] == 167_772_160 == 160 * MiB
    assert r["attention"] == "GQA" and r["block_tokens"] == 512 and r["tp"] == 1


def test_other_gqa_models():
    # Llama 3 8B: 32 layers * 8 KV heads * 128 * 2 * 2 B = 131,072 B = 128 KiB
    assert size("llama-3-8b")["bytes_per_token"] == 131_072
    # Llama 3.1 405B: 126 layers * 8 KV heads * 128 * 2 * 2 B = 516,096 B = 504 KiB
    assert size("llama-3.1-405b")["bytes_per_token"] == 516_096
    # Qwen2.5-7B: 28 layers * 4 KV heads * (3584 / 28 = 128) * 2 * 2 B = 57,344 B
    assert size("qwen2.5-7b")["bytes_per_token"] == 57_344
    # Qwen3-32B: 64 layers * 8 KV heads * head_dim 128 (explicit; 5120 / 64 would be 80)
    # * 2 * 2 B = 262,144 B = 256 KiB
    assert size("qwen3-32b")["bytes_per_token"] == 262_144
    # Qwen3-235B-A22B: 94 * 4 * 128 * 2 * 2 B = 192,512 B
    assert size("qwen3-235b-a22b")["bytes_per_token"] == 192_512
    # Mixtral 8x7B: attention of a dense 7B: 32 * 8 * 128 * 2 * 2 B = 131,072 B
    assert size("mixtral-8x7b")["bytes_per_token"] == 131_072


def test_deepseek_v3_mla_caches_the_latent_not_k_and_v():
    r = size("deepseek-v3", dtype="bf16")
    # (kv_lora_rank 512 + qk_rope_head_dim 64) * 61 layers * 2 B = 70,272 B (68.625 KiB)
    assert r["bytes_per_token"] == (512 + 64) * 61 * 2 == 70_272
    assert r["attention"] == "MLA" and r["kv_heads"] is None
    # Full K and V of its 128 heads would be 61 * 128 * (192 + 128) * 2 B = 4,997,120 B: 71x more.
    assert r["bytes_per_token"] * 71 < 61 * 128 * (192 + 128) * 2


def test_dtypes():
    # fp8: 1 byte: Llama 3 8B = 32 * 8 * 128 * 2 * 1 = 65,536 B
    assert size("llama-3-8b", dtype="fp8")["bytes_per_token"] == 65_536
    assert size("llama-3-8b", dtype="fp16")["bytes_per_token"] == 131_072
    assert size("llama-3-8b", dtype="float32")["bytes_per_token"] == 262_144
    with pytest.raises(ValueError):
        size("llama-3-8b", dtype="int3")


def test_tensor_parallel_per_rank_and_total():
    r = size("llama-3-70b", tp=8)
    # 8 KV heads over 8 ranks: 1 head per rank: 80 * 1 * 128 * 2 * 2 = 40,960 B per rank
    assert r["kv_heads_per_rank"] == 1
    assert r["bytes_per_token_per_rank"] == 40_960
    assert r["bytes_per_token_all_ranks"] == 8 * 40_960 == r["bytes_per_token"]
    r = size("llama-3-70b", tp=16)
    # more ranks than KV heads: every rank keeps one (replicated) head, so all ranks hold 2x
    assert r["bytes_per_token_per_rank"] == 40_960
    assert r["bytes_per_token_all_ranks"] == 16 * 40_960 == 2 * r["bytes_per_token"]
    with pytest.raises(ValueError):
        size("llama-3-70b", tp=3)  # 8 heads do not split over 3 ranks
    r = size("deepseek-v3", tp=8)
    # MLA: the latent is not split: every rank caches all 70,272 B
    assert r["bytes_per_token_per_rank"] == 70_272
    assert r["bytes_per_token_all_ranks"] == 8 * 70_272


def test_capacity_and_request():
    r = size("llama-3-70b", capacity_bytes=kv.parse_bytes("64GiB"), request_tokens=16_384)
    # 64 GiB = 68,719,476,736 B; / 327,680 B = 209,715.2 -> 209,715 tokens
    assert r["fit"]["tokens"] == 209_715
    # / 167,772,160 B per block = 409.6 -> 409 blocks
    assert r["fit"]["blocks"] == 409
    # a 16,384-token request is 32 blocks: 409 // 32 = 12 requests
    assert r["blocks_per_request"] == 32 and r["fit"]["requests"] == 12
    # 16,384 * 327,680 B = 5,368,709,120 B = 5 GiB
    assert r["bytes_per_request"] == 5 * GiB
    r = size("llama-3-8b", request_tokens=1000, block_tokens=512)
    # 1000 tokens need 2 blocks of 512; exact bytes 1000 * 131,072, in blocks 1024 * 131,072
    assert r["blocks_per_request"] == 2
    assert r["bytes_per_request"] == 131_072_000
    assert r["bytes_per_request_in_blocks"] == 134_217_728


def test_parse_bytes():
    assert kv.parse_bytes("64GiB") == 64 * GiB
    assert kv.parse_bytes("64G") == 64 * GiB
    assert kv.parse_bytes("500GB") == 500 * 10**9
    assert kv.parse_bytes("1.5TiB") == 3 * (1 << 39)
    assert kv.parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        kv.parse_bytes("lots")


def test_config_json_gqa_mqa_mla(tmp_path):
    def cfg(name, d):
        p = tmp_path / name
        p.mkdir()
        (p / "config.json").write_text(json.dumps(d))
        return str(p)

    # The published Meta-Llama-3-70B config.json keys: same as the built-in row.
    llama = cfg("llama", {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
                          "num_attention_heads": 64, "num_key_value_heads": 8})
    assert size(llama)["bytes_per_token"] == 327_680
    # No num_key_value_heads: MHA. 40 layers * 40 heads * (5120/40 = 128) * 2 * 2 = 819,200 B
    mha = cfg("mha", {"num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40})
    r = size(mha)
    assert r["attention"] == "MHA" and r["bytes_per_token"] == 819_200
    # Falcon-7B as transformers writes it now: num_kv_heads 71 is ignored without
    # new_decoder_architecture, multi_query means ONE KV head (MQA):
    # 32 layers * 1 * (4544 / 71 = 64) * 2 * 2 = 8,192 B
    falcon = cfg("falcon", {"model_type": "falcon", "num_hidden_layers": 32, "hidden_size": 4544,
                            "num_attention_heads": 71, "num_kv_heads": 71, "multi_query": True,
                            "new_decoder_architecture": False})
    r = size(falcon)
    assert r["attention"] == "MQA" and r["bytes_per_token"] == 8_192
    assert size("falcon-7b")["bytes_per_token"] == 8_192
    # Falcon-40B style (new_decoder_architecture): num_kv_heads 8:
    # 60 layers * 8 * (8192 / 128 = 64) * 2 * 2 = 122,880 B
    f40 = cfg("f40", {"model_type": "falcon", "num_hidden_layers": 60, "hidden_size": 8192,
                      "num_attention_heads": 128, "num_kv_heads": 8,
                      "new_decoder_architecture": True})
    assert size(f40)["bytes_per_token"] == 122_880
    # gpt_bigcode (StarCoder): multi_query true, n_head 48, n_embd 6144, n_layer 40:
    # 40 * 1 * 128 * 2 * 2 = 20,480 B
    sc = cfg("sc", {"model_type": "gpt_bigcode", "n_layer": 40, "n_embd": 6144, "n_head": 48,
                    "multi_query": True})
    assert size(sc)["bytes_per_token"] == 20_480
    # DeepSeek-V3's config.json (the keys that matter; num_key_value_heads 128 is not the
    # cache): (512 + 64) * 61 * 2 = 70,272 B
    ds = cfg("ds", {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
                    "num_attention_heads": 128, "num_key_value_heads": 128,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128})
    r = size(os.path.join(ds, "config.json"))
    assert r["attention"] == "MLA" and r["bytes_per_token"] == 70_272


def test_aliases():
    for name in ("llama3-70b", "Meta-Llama-3-70B-Instruct", "meta-llama/Meta-Llama-3-70B",
                 "llama-3.1-70b"):
        assert size(name)["bytes_per_token"] == 327_680, name
    assert size("deepseek-ai/DeepSeek-R1")["bytes_per_token"] == 70_272
    with pytest.raises(KeyError):
        kv.lookup("no-such-model")


def test_cli_json_and_text():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert kv.main(["--model", "llama-3-70b", "--json"]) == 0
    r = json.loads(out.getvalue())
    for k in ("model", "dtype", "tp", "bytes_per_token", "bytes_per_block", "block_tokens"):
        assert k in r
    assert (r["model"], r["dtype"], r["tp"], r["bytes_per_token"], r["block_tokens"]) == \
        ("llama-3-70b", "bf16", 1, 327_680, 512)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert kv.main(["--model", "deepseek-v3", "--capacity", "64GiB", "--tp", "8"]) == 0
    text = out.getvalue()
    assert "MLA" in text and "68.62 KiB (70,272 B)" in text
    # 64 GiB / (70,272 * 512 B per block) = 1,909.9 -> 1,909 blocks
    assert "1,909 blocks" in text


def test_console_script_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "mooncake.tools.kv_size", "--model", "qwen3-8b",
                        "--json"], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    # Qwen3-8B: 36 layers * 8 KV heads * 128 * 2 * 2 B = 147,456 B
    assert json.loads(r.stdout)["bytes_per_token"] == 147_456
    r = subprocess.run([sys.executable, "-m", "mooncake.tools.kv_size", "--model", "nope"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 2 and "unknown model" in r.stderr
