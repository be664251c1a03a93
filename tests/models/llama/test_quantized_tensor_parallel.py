"""Tensor-parallel Llama with quantized linears on the CPU (ranks as threads, NumPy kernels: test_tensor_parallel.py):
each rank holds exactly its slice of a checkpoint's codes and scales and reads only its rows, its logits match TP=1's
quantized ones, load-time quantization quantizes each rank's slice, and block scales that a rank's span would cut
are refused naming the tensor."""

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.models.deepseek_v2.test_step_code import forward
from tests.models.llama import numpy_kernels
from tests.models.llama.test_quantized_loading import assert_same_params
from tests.models.quantized_checks import W8A8_TOL     # measured here: 3.8% (2026-11-26)
from tests.models.ranks import ReadCounter, on_ranks
from tests.models.test_quantization import EXTRAS, LAYOUTS, write_quantized
from tilekit import parallel
from tilekit.kernels.checks import rel_err
from tilekit.engine import kv_cache
from tilekit.models import Llama, LlamaConfig, base
from tilekit.models.llama import model as model_module
from tilekit.models.llama.weights import random_state_dict, save_state_dict
from tilekit.models.quantization import QBLOCK, Scheme, quantize_weight, scale_key

# head_dim 128: each rank's q, k, v, o and MLP spans are whole 128-blocks at TP=2 (block scales shard)
CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=512, vocab_size=200,
                     max_position_embeddings=64, tie_word_embeddings=False, rope_scaling=None, head_dim=128)
COLUMNS = ("o_proj", "down_proj")           # row-parallel: their weights' columns split
# TP=2 against TP=1 with the same codes and scales: only the order of the row-parallel sums differs (as unquantized)
SAME_CODES_TOL = 1e-6
# load-time quantization: a row-parallel rank's scales are the absmax of its half of the columns (never larger than
# TP=1's, so its codes are at least as fine), and both models sit within their per-channel error of the float
# weights. Measured here (NumPy, float32 model, 2026-11-26): TP=2 vs TP=1 logits 0.9% (int8) and 3.4% (fp8); vs the
# unquantized model TP=2 1.3% / 4.9%, TP=1 1.4% / 5.1%.
LOAD_TIME_TOL = {"int8": 0.02, "fp8": 0.06}
VS_FLOAT = {"int8": 0.025, "fp8": 0.08}      # either model against the unquantized one, the same bound for both


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    step_code_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.MODEL_KERNELS),
                       (base, numpy_kernels, numpy_kernels.BASE_KERNELS), (kv_cache, numpy_kernels, numpy_kernels.CACHE_KERNELS))


def _checkpoint(tmp_path, layout, config=CONFIG):
    kind, strategy, qconfig, scale_shape = LAYOUTS[layout]
    write_quantized(tmp_path, kind, strategy, qconfig, scale_shape,
                    "weight_scale_inv" if layout == "block fp8" else "weight_scale", EXTRAS.get(layout, ()), config)
    return tmp_path


def _slice_of(name, array, rank, block):
    """Rank `rank` of 2's slice of a whole model's weight or scale `name` (TP=1's params)."""
    weight = name[:-len("_scale")] if name.endswith("_scale") else name
    if weight == "lm_head.weight":          # vocabulary rows, in blocks of parallel.VOCAB_GRANULE (codes and scales)
        start, stop = parallel.vocab_span(array.shape[0], rank, 2)
        return array[start:stop]
    row_parallel = weight.endswith(tuple(f"{m}.weight" for m in COLUMNS))
    if name.endswith("_scale") and not block:
        return array if row_parallel else np.array_split(array, 2)[rank]
    return np.array_split(array, 2, axis=1 if row_parallel else 0)[rank]


LAYOUTS_SHARDED = ["compressed-tensors fp8 channel", "compressed-tensors int8 channel", "modelopt FP8", "block fp8"]


@pytest.mark.parametrize("layout", LAYOUTS_SHARDED)
def test_each_rank_holds_its_slice_of_the_codes_and_scales(cpu, layout, tmp_path):
    path = _checkpoint(tmp_path, layout)
    whole = Llama.from_pretrained(path, dtype="float32")
    block = whole.quant.scale == "block"
    for rank in range(2):
        model = Llama.from_pretrained(path, dtype="float32", comm=parallel.ShapeOnly(rank, 2))
        assert model.quant == whole.quant and model.quantized == whole.quantized
        for name in whole.quantized:
            for key in (name, scale_key(name)):
                np.testing.assert_array_equal(model.params[key], _slice_of(key, whole.params[key], rank, block),
                                              err_msg=key)
        blk = model.blocks[0]      # the fused [q; k; v] and [gate; up] scales follow their row views
        assert blk.qkv_scale.shape[0] == (2 + 1 + 1) * 128 // (QBLOCK if block else 1)     # q, k, v
        assert blk.gate_up_scale.shape[0] == 2 * 256 // (QBLOCK if block else 1)


@pytest.mark.parametrize("layout", LAYOUTS_SHARDED)
def test_sharded_quantized_logits_equal_one_rank(cpu, layout, tmp_path):
    path = _checkpoint(tmp_path, layout)
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 7))
    whole = forward(Llama.from_pretrained(path, dtype="float32"), ids)
    per_rank = on_ranks(2, lambda comm: forward(Llama.from_pretrained(path, dtype="float32", comm=comm), ids))
    np.testing.assert_array_equal(per_rank[1], per_rank[0])
    assert rel_err(per_rank[0], whole) <= SAME_CODES_TOL


@pytest.mark.parametrize("layout", ["block fp8", "compressed-tensors fp8 channel"])
def test_sharded_w8a8_prefill(cpu, layout, tmp_path):
    """Prefill rows of FP8 weights quantize the activations per token: per 128-column group with block scales,
    which a rank's whole blocks keep (logits as TP=1's); per row with per-channel scales, which a row-parallel
    rank takes over its own slice of the row (finer than TP=1's, so the logits differ within the W8A8 bound)."""
    path = _checkpoint(tmp_path, layout)
    ids = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, base.W8A8_MIN_ROWS // 2))
    whole = forward(Llama.from_pretrained(path, dtype="float32"), ids)
    per_rank = on_ranks(2, lambda comm: forward(Llama.from_pretrained(path, dtype="float32", comm=comm), ids))
    np.testing.assert_array_equal(per_rank[1], per_rank[0])
    err = rel_err(per_rank[0], whole)
    if layout == "block fp8":
        assert err <= SAME_CODES_TOL
    else:
        assert 0 < err <= W8A8_TOL


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_load_time_quantization_quantizes_each_ranks_slice(cpu, kind, tmp_path):
    state = random_state_dict(CONFIG, 3)
    save_state_dict(tmp_path, CONFIG, state)
    ids = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 7))
    whole = Llama.from_pretrained(tmp_path, dtype="float32", quantize=kind, quantize_head=True)

    def run(comm):           # the LM head quantized too: a rank holds its vocabulary rows' codes and scales
        model = Llama.from_pretrained(tmp_path, dtype="float32", quantize=kind, quantize_head=True, comm=comm)
        assert "lm_head.weight" in model.quantized
        for name in model.quantized:
            mine = _slice_of(name, np.asarray(state[name], np.float32), comm.rank, False)
            codes, scale = quantize_weight(mine, kind)      # the absmax of this rank's slice
            np.testing.assert_array_equal(model.params[name], codes, err_msg=name)
            np.testing.assert_array_equal(model.params[scale_key(name)], scale, err_msg=name)
            if not name.endswith(tuple(f"{m}.weight" for m in COLUMNS)):   # column-parallel: TP=1's rows
                np.testing.assert_array_equal(model.params[name], _slice_of(name, whole.params[name], comm.rank,
                                                                            False), err_msg=name)
        assert_same_params(model, Llama(CONFIG, dtype="float32", state=state, quantize=Scheme(kind, head=True),
                                        comm=parallel.ShapeOnly(comm.rank, 2)))             # state= alike
        return forward(model, ids)
    per_rank = on_ranks(2, run)
    np.testing.assert_array_equal(per_rank[1], per_rank[0])
    err = rel_err(per_rank[0], forward(whole, ids))
    assert 0 < err <= LOAD_TIME_TOL[kind]        # not bit for bit: the row-parallel scales differ
    unquantized = forward(Llama.from_pretrained(tmp_path, dtype="float32"), ids)
    assert rel_err(per_rank[0], unquantized) <= VS_FLOAT[kind] and rel_err(forward(whole, ids),
                                                                         unquantized) <= VS_FLOAT[kind]


def test_a_rank_reads_only_its_rows_of_codes_and_scales(cpu, monkeypatch, tmp_path):
    """Column-parallel codes and per-channel scales are read by rows, alone: half of their bytes per rank;
    row-parallel codes are read whole and sliced on the device, their per-channel scales whole."""
    path = _checkpoint(tmp_path, "compressed-tensors fp8 channel")
    counter = ReadCounter(monkeypatch, path)
    p = "model.layers.1."
    halves = [p + f"{m}.{t}" for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")
              for t in ("weight", "weight_scale")]
    wholes = [p + "self_attn.o_proj.weight_scale", p + "mlp.down_proj.weight_scale", p + "mlp.down_proj.weight"]
    for rank in range(2):
        counter.clear()
        Llama.from_pretrained(path, dtype="float32", comm=parallel.ShapeOnly(rank, 2))
        for name in halves:
            assert counter.read(name) == counter.size(name) // 2, name
        for name in wholes:
            assert counter.read(name) == counter.size(name), name


def test_block_scales_a_rank_would_cut_are_refused(cpu, tmp_path):
    path = _checkpoint(tmp_path, "block fp8", CONFIG.replace(head_dim=64))     # k and v: 64 rows per rank
    Llama.from_pretrained(path, dtype="float32")                                # one rank: fine
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight': a tensor-parallel "
                                         r"rank's rows 0:64 of 128 are not whole 128-blocks"):
        Llama.from_pretrained(path, dtype="float32", comm=parallel.ShapeOnly(0, 2))
    path = _checkpoint(tmp_path / "mlp", "block fp8", CONFIG.replace(intermediate_size=384))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight': a tensor-parallel rank's rows "
                                         r"192:384 of 384"):
        Llama.from_pretrained(path, dtype="float32", comm=parallel.ShapeOnly(1, 2))


def test_a_sharded_model_is_not_saved(cpu, tmp_path):
    path = _checkpoint(tmp_path / "in", "compressed-tensors fp8 channel")
    model = Llama.from_pretrained(path, dtype="float32", comm=parallel.ShapeOnly(0, 2))
    with pytest.raises(ValueError, match="save_pretrained of a tensor-parallel model"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rank_runs_its_quantized_shard_shapes():
    """What `tilekit tune --tp 2` tunes for a quantized model: its rank's quant_linear shapes."""
    config = LlamaConfig.preset("llama-3.1-70b")

    def shapes(comm):
        calls = Llama(config, meta=True, quantize="fp8", comm=comm).kernel_problems(1, 64, 4)
        return {(p["N"], p["K"]) for op, p in calls if op.name == "quant_linear"}
    assert shapes(parallel.ShapeOnly(0, 2)) == {((32 + 2 * 4) * 128, 8192), (8192, 32 * 128),   # q/k/v, o
                                                 (28672 // 2, 8192), (8192, 28672 // 2)}        # gate/up (N: out), down


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_head_computes_the_dequantized_models_logits(cpu, kind, tmp_path):
    """The step code on NumPy kernels: a float32 model quantized at load, its LM head included, gives the float64
    reference's logits over its own dequantized weights (state_dict()), head included."""
    from tilekit.models.llama.reference import ReferenceLlama
    save_state_dict(tmp_path, CONFIG, random_state_dict(CONFIG, 5))
    model = Llama.from_pretrained(tmp_path, dtype="float32", quantize=kind, quantize_head=True)
    assert "lm_head.weight" in model.quantized
    ids = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 9))
    expected = ReferenceLlama(CONFIG, model.state_dict()).forward(ids)
    assert rel_err(forward(model, ids), expected) <= 1e-5
