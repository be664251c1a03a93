"""benchmarks.studies.tp without a GPU: its table from rank results (rows labelled "tp=N ...", ratios to the smallest
size, the peer-memory run of a size beside its NCCL one, scaling efficiency, % of the rank's floor, the profile, the all-reduce per layer and its share of the step, bus
bandwidth against NVLink, greedy agreement; the larger sizes' rows alone when TP=1 did not fit), --tp's sizes, the
busy time of overlapping kernel spans."""

import argparse

import pytest

from benchmarks.studies import tp
from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tilekit.autotune.arrays import numpy_dtype
from tilekit.models.families import preset_config


def test_table_rows():
    config = preset_config("llama-3.1-8b")
    results = {"tp=1": dict(tp=1, rows=[dict(kind="decode", batch=1, ms=6.0, floor_ms=4.5), dict(kind="decode", batch=8, ms=7.0),
                             dict(kind="prefill", batch=8, ms=300.0)], tokens=[[5, 6, 7, 8]]),
               "tp=2": dict(tp=2, rows=[dict(kind="decode", batch=1, ms=3.6), dict(kind="decode", batch=8, ms=4.2),
                             dict(kind="profile", batch=1, span_us=3500.0, all_reduce_us=600.0, compute_us=2700.0,
                                  idle_us=200.0, kernels=400),
                             dict(kind="prefill", batch=8, ms=160.0),
                             dict(kind="all_reduce", batch=1, bytes=8192, us=9.0),
                             dict(kind="all_reduce", batch=8, bytes=65536, us=10.0),
                             dict(kind="all_reduce", batch=None, bytes=1 << 28, us=900.0, busbw_gbs=300.0)],
                        tokens=[[5, 6, 9, 8]])}
    results["tp=2 nccl"] = dict(results["tp=2"], rows=[dict(r, ms=r["ms"] * 1.1) if "ms" in r else r
                                                      for r in results["tp=2"]["rows"]])
    table = tp.format_table(results, config, 450.0).splitlines()
    assert "| tp=1 decode B1 ms/token | 6.000 | 1.00x | 100% | 75% of 4.500 |" in table
    assert "| tp=2 decode B1 ms/token | 3.600 | 0.60x | 83% |  |" in table
    assert "| tp=1 prefill B8 T1024 ms | 300.000 | 1.00x | 100% |  |" in table
    assert "| tp=2 nccl decode B1 ms/token | 3.960 | 0.66x | 76% |  |" in table
    assert any(line.startswith("| tp=2 decode B1 profile (rank 0, us per step): kernels span 3500, all-reduce 600, "
                               "other kernels 2700, idle 200 (400 kernels)") for line in table)
    assert any(line.startswith("| tp=2 all-reduce B1 (8192 B): 9.0 us, 18.0 us/layer, 0.576 ms/step (16% of the step)")
               for line in table)
    assert any("bus bandwidth 300 GB/s (67% of NVLink's 450 GB/s)" in line for line in table)
    assert any("greedy B1 tokens agreeing with tp=1: 2 of 4" in line for line in table)
    alone = tp.format_table({"tp=2": results["tp=2"]}, config, 450.0).splitlines()     # a TP=1 run that did not fit
    assert "| tp=2 decode B1 ms/token | 3.600 | 1.00x | 100% |  |" in alone and not any("greedy" in l for l in alone)


def test_tp_sizes():
    assert tp.tp_sizes("4,1,2,4") == [1, 2, 4]
    for bad in ("0,2", "two", "", "2,-4"):
        with pytest.raises(argparse.ArgumentTypeError, match="--tp"):
            tp.tp_sizes(bad)


def test_busy_time_counts_overlaps_once():
    assert tp.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert tp.busy_us([]) == 0


def test_the_model_shape_is_a_presets():
    assert tp.model_config("deepseek-v2-lite", None) == preset_config("deepseek-v2-lite")
    assert tp.model_config("llama-3.1-8b", 2).n_layer == 2
    assert tp.checkpoint_path("deepseek-v2-lite").name == "tilekit-tp-deepseek-v2-lite"
    assert tp.checkpoint_path("llama-3.1-70b", "fp8").name == "tilekit-tp-llama-3.1-70b-fp8"
    assert tp.model_config("llama-3.1-70b", None).n_embd == 8192


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_checkpoint_is_drawn_a_tensor_at_a_time_and_loads(numpy_cupy, kind, tmp_path):
    """drawn_tensors through hf.write_checkpoint (NumPy standing in for CuPy): a compressed-tensors checkpoint the
    model loads quantized, each linear's codes and scales those of its own draw, the other tensors their draws in
    bf16."""
    import numpy as np

    from tilekit.models import Llama, LlamaConfig, quantization
    from tilekit import checkpoints as hf
    from tilekit.models.llama import weights
    config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=192, vocab_size=64,
                         max_position_embeddings=64, tie_word_embeddings=False, rope_scaling=None)
    tensors, raw = tp.drawn_tensors(weights, config, kind, seed=7)
    hf.write_checkpoint(tmp_path, dict(config.to_hf_dict(), quantization_config=quantization.
                                       compressed_tensors_config(quantization.Scheme(kind))), tensors,
                        dtype="bfloat16", raw=raw)
    model = Llama.from_pretrained(tmp_path, dtype="float32")
    assert model.quant.weight == kind
    shapes = weights.state_dict_shapes(config)
    for i, name in enumerate(shapes):
        mean, std = weights.weight_stats(config, name)
        w = np.random.default_rng(7 + i).standard_normal(shapes[name], dtype=np.float32) * std + mean
        if name in model.quantized:
            codes, scale = quantization.quantize_weight(w, kind)
            np.testing.assert_array_equal(model.params[name], codes, err_msg=name)
            np.testing.assert_array_equal(model.params[quantization.scale_key(name)], scale, err_msg=name)
        else:
            np.testing.assert_array_equal(model.params[name], w.astype(numpy_dtype("bfloat16")).astype(np.float32),
                                          err_msg=name)


def test_only_families_whose_files_hold_their_own_tensors_are_drawn_a_tensor_at_a_time():
    from tilekit.models.deepseek_v2 import weights as deepseek_weights
    from tilekit.models.llama import weights as llama_weights
    assert tp.drawn_as_stored(llama_weights)
    assert not tp.drawn_as_stored(deepseek_weights)     # experts kept as stacked tensors, some linears dequantized
