import pandas as pd
import pytest
import torch

from kvbench.kv.capture import capture_kv
from kvbench.kv.study import KVSettings, document_rows, pick_documents, run_study
from kvbench.kv.summary import claim_text, inflation_factors
from kvbench.models import DUMMY_RANGE, load_model

SETTINGS = KVSettings(
    context_tokens=300,
    docs_per_corpus=2,
    dtypes=("fp16", "bf16", "fp8_e4m3"),
    codecs=("none", "zstd-1", "zstd-3+byteplane", "lz4+byteplane"),
    detail_dtypes=("fp16",),
    detail_codecs=("zstd-3",),
    chunk_tokens=256,
    repeats=1,
)


@pytest.fixture(scope="module")
def real_model(model_dir):
    return load_model(model_dir, "real")


@pytest.fixture(scope="module")
def real_kv(real_model, tokenizer):
    text = "The patient was admitted with community-acquired pneumonia and treated with ceftriaxone. " * 20
    ids = tokenizer(text).input_ids[:300]
    return capture_kv(real_model, ids), ids


def test_capture_returns_every_layer_token_major(real_model, real_kv):
    (keys, values), ids = real_kv
    cfg = real_model.config
    assert keys.shape == values.shape == (cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads * cfg.head_dim)
    assert keys.dtype == torch.float32
    with torch.inference_mode():
        cache = real_model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    layer = cache.layers[7]
    assert torch.equal(keys[7], layer.keys[0].transpose(0, 1).reshape(len(ids), -1))
    assert torch.equal(values[7], layer.values[0].transpose(0, 1).reshape(len(ids), -1))


def test_rows_cover_every_dtype_codec_part_layer_and_chunk(real_kv):
    (keys, values), ids = real_kv
    whole, layers, chunks = document_rows(keys, values, SETTINGS, {"doc_id": "d"})
    assert len(whole) == 3 * 2 * 4
    assert len(layers) == 1 * 2 * keys.shape[0] * 1
    assert [c["chunk_tokens"] for c in chunks] == [256, 44]
    # Exact round trip for every codec and dtype on real KV tensors.
    assert all(r["error"] is None for r in whole + layers + chunks)
    fp16_k = [r for r in whole if r["dtype"] == "fp16" and r["part"] == "K"]
    assert {r["raw_bytes"] for r in fp16_k} == {keys.numel() * 2}
    assert next(r for r in fp16_k if r["codec"] == "none")["ratio"] == 1.0
    fp8 = next(r for r in whole if r["dtype"] == "fp8_e4m3" and r["part"] == "K")
    assert fp8["raw_bytes"] == keys.numel()
    assert all(r["unique_values"] <= 65536 for r in whole)


def test_weight_variants_are_deterministic(model_dir):
    dummy_a, dummy_b = load_model(model_dir, "dummy", seed=3), load_model(model_dir, "dummy", seed=3)
    for (name, a), b in zip(dummy_a.state_dict().items(), dummy_b.state_dict().values()):
        assert torch.equal(a, b), name
        assert a.abs().max() <= DUMMY_RANGE
    # As vLLM's dummy loader: one generator per parameter, seeded the same.
    sd = dummy_a.state_dict()
    q, k = sd["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(q.flatten()[:1000], k.flatten()[:1000])
    rand_a, rand_c = load_model(model_dir, "random", seed=3), load_model(model_dir, "random", seed=4)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(rand_a.state_dict()[w], load_model(model_dir, "random", seed=3).state_dict()[w])
    assert not torch.equal(rand_a.state_dict()[w], rand_c.state_dict()[w])


def test_pick_documents_round_robins_domains_and_doc_types():
    docs = pd.DataFrame(
        {
            "doc_id": ["la0", "la1", "lb0", "lc0", "ma0", "mb0", "mb1"],
            "domain": ["legal", "legal", "legal", "legal", "medical", "medical", "medical"],
            "doc_type": ["la", "la", "lb", "lc", "ma", "mb", "mb"],
        }
    )
    assert list(pick_documents(docs, 4).doc_id) == ["la0", "ma0", "lb0", "mb0"]
    assert list(pick_documents(docs, 7).doc_id) == ["la0", "ma0", "lb0", "mb0", "lc0", "la1", "mb1"]


def test_fake_failure_on_one_document_is_recorded_not_dropped(real_model, tokenizer):
    docs = pd.DataFrame(
        {
            "doc_id": ["ok", "bad"],
            "corpus": "c",
            "domain": "d",
            "doc_type": ["x", "y"],
            "text": ["A short document.", "FAIL"],
        }
    )

    def encode(text):
        if text == "FAIL":
            raise MemoryError("provoked out-of-memory")
        return tokenizer(text).input_ids

    whole, _, _ = run_study(real_model, encode, docs, SETTINGS, "real")
    bad = whole[whole.doc_id == "bad"]
    assert len(bad) == 1 and bad.error.iloc[0] == "MemoryError: provoked out-of-memory"
    assert whole[whole.doc_id == "ok"].error.isna().all()


def test_inflation_factor_is_the_ratio_of_pooled_ratios():
    rows = []
    for corpus, weights, comp in [
        ("realistic", "real", 80),
        ("realistic", "dummy", 20),
        ("synthetic", "real", 40),
        ("synthetic", "dummy", 5),
    ]:
        for part in ("K", "V"):
            rows.append(
                {
                    "corpus": corpus,
                    "weights": weights,
                    "dtype": "fp16",
                    "codec": "zstd-3",
                    "part": part,
                    "doc_id": "d",
                    "raw_bytes": 100,
                    "compressed_bytes": comp,
                    "error": None,
                }
            )
    factors = inflation_factors(pd.DataFrame(rows)).set_index(["comparison", "held_fixed"])
    assert factors.loc[("dummy_vs_real", "corpus=realistic"), "inflation"] == pytest.approx(4.0)
    assert factors.loc[("synthetic_vs_realistic", "weights=real"), "inflation"] == pytest.approx(2.0)
    combined = factors.loc[("synthetic+dummy_vs_realistic+real", "-")]
    assert combined.benchmark_ratio == pytest.approx(20.0) and combined.realistic_ratio == pytest.approx(1.25)
    assert combined.inflation == pytest.approx(16.0)
    assert "inflation  16.00x" in claim_text(factors.reset_index())


def test_underflow_is_counted_per_dtype_to_the_bit():
    from kvbench.kv.storage import store

    # fp16: smallest normal 6.1e-5, smallest subnormal 6.0e-8; bf16 has fp32's range; fp8 e4m3:
    # smallest normal 2^-6, smallest subnormal 2^-9.
    x = torch.tensor([1e-6, 1e-8, 0.0, 1.0, 7e-5, -3e-7])
    counts = {
        d: (s.below_normal, s.flushed_to_zero, s.values) for d in ("fp16", "bf16", "fp8_e4m3") for s in [store(x, d)]
    }
    assert counts == {"fp16": (3, 1, 6), "bf16": (0, 0, 6), "fp8_e4m3": (4, 4, 6)}


def test_dummy_weights_underflow_fp16_and_vanish_in_fp8(model_dir, tokenizer):
    from kvbench.kv.storage import store

    ids = tokenizer("The patient was admitted with pneumonia. " * 8).input_ids
    keys, _ = capture_kv(load_model(model_dir, "dummy", seed=1), ids)
    fp16, bf16, fp8 = (store(keys, d) for d in ("fp16", "bf16", "fp8_e4m3"))
    assert fp16.below_normal / fp16.values > 0.9  # |x| ~ 1e-6: subnormal at fp16
    assert bf16.below_normal == 0 and bf16.flushed_to_zero == 0
    assert fp8.flushed_to_zero == fp8.values - int((keys == 0).sum())  # every nonzero value became +-0
    assert fp8.unique_values <= 2


def test_summary_puts_per_layer_ratios_and_underflow_beside_whole_cache_ratios():
    whole, layers = [], []
    for corpus, weights, comp, below in [("realistic", "real", 80, 0), ("synthetic", "dummy", 5, 90)]:
        for part in ("K", "V"):
            key = {
                "corpus": corpus,
                "weights": weights,
                "dtype": "fp16",
                "codec": "zstd-3",
                "part": part,
                "doc_id": "d",
                "error": None,
            }
            whole.append(
                {
                    **key,
                    "raw_bytes": 100,
                    "compressed_bytes": comp,
                    "values": 50,
                    "below_normal": below // 2,
                    "flushed_to_zero": 0,
                }
            )
            for layer in range(2):  # each layer alone compresses less than the whole cache
                layers.append({**key, "layer": layer, "raw_bytes": 50, "compressed_bytes": comp, "values": 25})
    factors = inflation_factors(pd.DataFrame(whole), pd.DataFrame(layers)).set_index("comparison")
    row = factors.loc["synthetic+dummy_vs_realistic+real"]
    assert row.inflation == pytest.approx(16.0)
    assert row.benchmark_layer_ratio == pytest.approx(10.0) and row.realistic_layer_ratio == pytest.approx(0.625)
    assert row.layer_inflation == pytest.approx(16.0)
    assert row.benchmark_below_normal_pct == pytest.approx(90.0) and row.realistic_below_normal_pct == 0.0
    assert "per layer 10.00x vs 0.62x" in claim_text(factors.reset_index())
