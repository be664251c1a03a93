"""The GPT model on the GPU against the NumPy reference, KV-cache and CUDA-graph decoding against recomputation."""

from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err

cupy = pytest.importorskip("cupy")

from tilekit.models import GPT, GPTConfig, ReferenceGPT  # noqa: E402
from tilekit import checkpoints as hf
from tilekit.models.gpt2.weights import random_state_dict  # noqa: E402

pytestmark = pytest.mark.gpu

TINY = Path(__file__).resolve().parents[2] / "data" / "tiny-gpt2"
MODEL_TOL = {"float32": 1e-4, "tf32": 5e-3, "bfloat16": 3e-2}


def logits_error(model: GPT, reference: ReferenceGPT, ids) -> float:
    return rel_err(cupy.asnumpy(model(ids)).astype(np.float64), reference.forward(ids))


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_logits_match_reference_at_preset_shapes(preset):
    """Every per-layer shape of the preset (two layers, to keep the float64 reference quick)."""
    config = GPTConfig.preset(preset).replace(n_layer=2)
    state = random_state_dict(config, seed=1)
    reference = ReferenceGPT(config, state)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 37))
    for dtype, tf32 in (("float32", False), ("float32", True), ("bfloat16", False)):
        model = GPT(config, dtype=dtype, state=state, allow_tf32=tf32)
        err = logits_error(model, reference, ids)
        assert err < MODEL_TOL["tf32" if tf32 else dtype], (preset, dtype, tf32, err)


def test_tiny_checkpoint_matches_hugging_face():
    model = GPT.from_pretrained(TINY, dtype="float32")
    ids = np.load(TINY / "input_ids.npy")
    assert rel_err(cupy.asnumpy(model(ids)), np.load(TINY / "logits.npy")) < 1e-5


def greedy_by_recomputation(model: GPT, prompt, n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        logits = cupy.asnumpy(model(np.array([seq])))[0, -1]
        seq.append(int(np.argmax(logits)))
    return seq


@pytest.fixture(scope="module")
def small_fp32():
    config = GPTConfig.preset("gpt2").replace(n_layer=2, block_size=256)
    return GPT(config, dtype="float32", seed=3)


def test_kv_cache_greedy_equals_recomputation(small_fp32):
    prompts = [[5, 17, 900, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42]]   # different lengths in one batch
    out = small_fp32.generate(prompts, 12, temperature=0)
    for prompt, seq in zip(prompts, out):
        assert seq.tolist() == greedy_by_recomputation(small_fp32, prompt, 12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager_decode(dtype):
    """Call 1 captures the decode step, call 2 the prompt prefill, call 3 replays both: every call
    equals eager kernels on its own fresh ragged prompts."""
    config = GPTConfig.preset("gpt2").replace(n_layer=2, block_size=256)
    model = GPT(config, dtype=dtype, seed=4)
    rng = np.random.default_rng(1)
    for call in range(3):
        prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (20, 7, 33)]
        graph = model.generate(prompts, 30, temperature=0)
        eager = model.generate(prompts, 30, temperature=0, use_graph=False)
        assert [s.tolist() for s in graph] == [s.tolist() for s in eager], call
    (gen,) = model.runner._generations.values()
    assert gen.decode_graph is not None and gen.prompts[64].graph is not None
    model.forget_graphs()
    assert not model.runner._generations


def test_concurrent_generate_calls(small_fp32):
    """Two threads generating at once on one model each get their own answer."""
    import threading
    rng = np.random.default_rng(12)
    batches = [rng.integers(0, small_fp32.config.vocab_size, (2, 9)) for _ in range(4)]
    expected = [[s.tolist() for s in small_fp32.generate(b, 10, temperature=0)] for b in batches]
    got = [None] * len(batches)

    def work(i):
        got[i] = [s.tolist() for s in small_fp32.generate(batches[i], 10, temperature=0)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def test_graph_forward_equals_eager_forward(small_fp32):
    """Replayed prefill graphs read each call's ids, keep shapes and streams apart, and survive eviction."""
    model, rng, V = small_fp32, np.random.default_rng(8), small_fp32.config.vocab_size
    shapes = [(2, 16), (1, 40), (3, 7)]
    model.forget_graphs()
    old_max, model.runner.max_prefill_graphs = model.runner.max_prefill_graphs, 2
    try:
        for round_ in range(2):                      # the second round replays or re-captures
            for B, T in shapes:
                ids = rng.integers(0, V, (B, T))
                eager = cupy.asnumpy(model(ids, use_graph=False))
                assert rel_err(cupy.asnumpy(model(ids)), eager) < 1e-5, (round_, B, T)
            assert len(model.runner._graphs) == 2           # the least recently used graph was dropped
        side = cupy.cuda.Stream(non_blocking=True)
        ids = rng.integers(0, V, (2, 16))
        eager = cupy.asnumpy(model(ids, use_graph=False))
        with side:
            on_side = model(ids)
        side.synchronize()
        assert rel_err(cupy.asnumpy(on_side), eager) < 1e-5
        first, second = model(ids), model(rng.integers(0, V, (2, 16)))
        assert rel_err(cupy.asnumpy(first), eager) < 1e-5, "a later call overwrote an earlier result"
        assert rel_err(cupy.asnumpy(second), eager) > 1e-2
    finally:
        model.runner.max_prefill_graphs = old_max
        model.forget_graphs()
    assert not model.runner._graphs


def test_sampling(small_fp32):
    prompts = [[1, 2, 3], [7, 8]]
    a = small_fp32.generate(prompts, 10, temperature=0.8, top_k=40, top_p=0.9, seed=11)
    b = small_fp32.generate(prompts, 10, temperature=0.8, top_k=40, top_p=0.9, seed=11)
    assert [s.tolist() for s in a] == [s.tolist() for s in b]
    top1 = small_fp32.generate(prompts, 10, temperature=1.0, top_k=1, seed=5)
    greedy = small_fp32.generate(prompts, 10, temperature=0)
    assert [s.tolist() for s in top1] == [s.tolist() for s in greedy]


def test_eos_stops_each_sequence(small_fp32):
    prompt = [[10, 11, 12]]
    free = small_fp32.generate(prompt, 8, temperature=0)[0]
    eos = int(free[3 + 2])                  # the third generated token
    stopped = small_fp32.generate(prompt, 8, temperature=0, eos_token_id=eos)[0]
    first = 3 + int(np.flatnonzero(free[3:] == eos)[0])
    assert stopped.tolist() == free[:first + 1].tolist()


def test_generate_text_and_save_round_trip(tmp_path):
    model = GPT.from_pretrained(TINY, dtype="float32")
    streamed = []
    text = model.generate_text("the quick brown fox", 10, temperature=0, stream_to=streamed.append)
    assert isinstance(text, str) and "".join(streamed) == text
    model.save_pretrained(tmp_path)
    again = GPT.from_pretrained(tmp_path, dtype="float32")
    for name, array in model.state_dict().items():
        assert np.array_equal(array, again.state_dict()[name]), name


def test_ids_from_any_array_library(small_fp32):
    """ids may be NumPy, lists, CuPy, or torch on the CPU or the GPU; all give the same logits
    (up to split-K summation order)."""
    ids = np.random.default_rng(3).integers(0, small_fp32.config.vocab_size, (2, 7))
    expected = cupy.asnumpy(small_fp32(ids))
    inputs = [ids.tolist(), cupy.asarray(ids)]
    torch = pytest.importorskip("torch")
    inputs += [torch.from_numpy(ids), torch.from_numpy(ids).cuda()]
    for given in inputs:
        assert rel_err(cupy.asnumpy(small_fp32(given)), expected) < 1e-5, type(given)
    with pytest.raises(TypeError, match="ids must be an integer array"):
        small_fp32([[1, 2], [3]])


def test_bad_input_is_refused(small_fp32):
    V, P = small_fp32.config.vocab_size, small_fp32.config.block_size
    with pytest.raises(ValueError, match=r"ids must lie in \[0, "):
        small_fp32(np.array([[0, V]]))
    with pytest.raises(ValueError, match="more than block_size"):
        small_fp32(np.zeros((1, P + 1), np.int64))
    with pytest.raises(TypeError, match="ids must be integers"):
        small_fp32(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="non-empty 2-D"):
        small_fp32(np.zeros((0, 4), np.int64))
    with pytest.raises(ValueError, match="exceeds block_size"):
        small_fp32.generate([[1, 2]], P)
    with pytest.raises(ValueError, match="temperature"):
        small_fp32.generate([[1, 2]], 3, temperature=-1)
    bad = random_state_dict(small_fp32.config, seed=0)
    bad["h.0.mlp.c_fc.weight"] = bad["h.0.mlp.c_fc.weight"][:, :10]
    with pytest.raises(ValueError, match="h.0.mlp.c_fc.weight"):
        GPT(small_fp32.config, state=bad)


def test_the_tuning_workload_is_what_forward_and_generate_request(small_fp32):
    """Every kernel problem that forward() and generate() launch (recorded from real calls) is one
    `tilekit tune --model` tunes, and nothing else: the workload is the same step code, dry-run."""
    from tilekit.autotune.op import recording
    from tilekit.engine.workload import model_problems

    def problems(calls):
        return {(op.name, tuple(sorted(p.items()))) for op, p in calls}

    model, rng = small_fp32, np.random.default_rng(21)
    model.forget_graphs()
    ids = rng.integers(0, model.config.vocab_size, (2, 40))
    with recording() as real:
        model(ids)
        model.generate(ids, 30, temperature=0)
        model.generate(ids, 30, temperature=0)          # replays: nothing new
        model.generate(ids, 30, temperature=1.0, top_k=50)   # Hugging Face's default sampling
    assert problems(real) == problems(model.kernel_problems(2, 40) + model.kernel_problems(2, 40, 30))
    tuned = {(op.name, op.problem_key(p)[1]) for op, p in model_problems(model.config, "float32", (2,), (40,), 30)}
    assert {(op.name, op.problem_key(p)[1]) for op, p in real} == tuned


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_from_pretrained_streams_into_the_models_own_arrays(tmp_path, dtype):
    """Every weight on the GPU bit for bit as the host loader converts it, the blocks reading those very arrays;
    saved in the model's dtype, read back bit for bit."""
    model = GPT.from_pretrained(TINY, dtype=dtype)
    host = GPT.weights.load(model.checkpoint, model.config, dtype=dtype, device=hf.HostDevice())
    assert model.params.keys() == host.keys() and model.blocks[1].fc_w is model.params["h.1.mlp.c_fc.weight"]
    for key, array in model.params.items():
        assert isinstance(array, cupy.ndarray) and array.dtype == host[key].dtype, key
        assert np.array_equal(cupy.asnumpy(array).view(np.uint8), host[key].view(np.uint8)), key
    if dtype != "float16":
        model.save_pretrained(tmp_path)
        again = GPT.from_pretrained(tmp_path, dtype=dtype)
        assert all(np.array_equal(cupy.asnumpy(a).view(np.uint8), cupy.asnumpy(again.params[k]).view(np.uint8))
                   for k, a in model.params.items())


def test_random_device_weights_are_deterministic_and_scaled():
    """Drawn on the GPU (a gpt2-xl-sized model initialises in seconds), as weight_stats scales them."""
    config = GPTConfig.preset("gpt2").replace(n_layer=4)
    a, b = GPT(config, dtype="float32", seed=7).state_dict(), GPT(config, dtype="float32", seed=7).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert abs(float(np.std(a["h.0.attn.c_attn.weight"])) - 0.02) < 0.001
    assert abs(float(np.std(a["h.3.mlp.c_proj.weight"])) - 0.02 / np.sqrt(8)) < 0.001
    assert abs(float(np.mean(a["h.2.ln_1.weight"])) - 1.0) < 0.02
