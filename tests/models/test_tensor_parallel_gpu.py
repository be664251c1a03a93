"""Tensor-parallel Llama, GPT-2 and DeepSeek-V2 on two GPUs of one host (and four, where the host has them): the
ranks are processes started by parallel.launch (tp_worker.py), joined through NCCL. TP=N logits equal TP=1's within
the dtype's tolerance (and transformers'), greedy tokens agree over 32 steps, graph and eager agree, every rank holds
the same logits and tokens (an unseeded sampled run included: the ranks agree on its seed), with decode's small
all-reduces through peer memory (the default) and through NCCL alone, and a rank that dies makes the other exit
instead of hanging inside NCCL."""

import sys
from pathlib import Path

import numpy as np
import pytest

from tests import conftest
from tilekit.kernels.checks import rel_err

cupy = pytest.importorskip("cupy")

from tilekit import parallel  # noqa: E402
from tilekit.models import families  # noqa: E402

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[1] / "data"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def gpu_count() -> int:
    """The host's GPUs (conftest.HOST_GPUS where the spread confines this worker to one)."""
    if conftest.HOST_GPUS:
        return conftest.HOST_GPUS
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


def need_gpus(count: int) -> None:
    if gpu_count() < count:
        pytest.skip(f"this test needs {count} GPUs, this host shows {gpu_count()}")


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch):
    """Skips below 2 GPUs; the ranks a test starts see every GPU, even from a worker the spread confines to one."""
    need_gpus(2)
    if conftest.HOST_GPUS:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")


def ranks(checkpoint, dtype: str, out: Path, world: int = 2, *extra) -> list[dict]:
    status = parallel.launch(world, ["-m", "tests.models.tp_worker", str(checkpoint), dtype, str(out), *extra],
                             program=[sys.executable], quiet_ranks=False)
    assert status == 0, status
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]


def wide_checkpoint(tmp_path_factory, preset: str, **changes) -> Path:
    """A random two-layer bf16 checkpoint of a preset's layer shapes, with a smaller vocabulary."""
    config = families.preset_config(preset).replace(n_layer=2, vocab_size=4099, bos_token_id=1, eos_token_id=2,
                                                    **changes)
    weights = families.family_of_config(config).model_class.weights
    path = tmp_path_factory.mktemp(preset)
    weights.save_state_dict(path, config, weights.random_state_dict(config, seed=3), dtype="bfloat16")
    return path


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Llama-3.1-8B's layer shapes (GQA 32/8 heads of 128)."""
    return wide_checkpoint(tmp_path_factory, "llama-3.1-8b")


@pytest.fixture(scope="module")
def wide_deepseek(tmp_path_factory):
    """DeepSeek-V2-Lite's layer shapes (16 MLA heads over a 512 + 64 latent, a dense layer of 10944 columns, a MoE
    layer of experts of 1408 columns choosing 6 routed + 2 shared), 16 routed experts instead of 64 (a smaller
    file; a rank still holds every expert's half)."""
    return wide_checkpoint(tmp_path_factory, "deepseek-v2-lite", n_routed_experts=16)


# world 4: fewer KV heads than ranks (tiny Llamas: 2 and 1) replicates them; 8B shapes split 8 KV heads in 4
@pytest.mark.parametrize("name, dtype, world", [
    ("tiny-llama", "float32", 2), ("tiny-llama-tied", "float32", 2), ("wide", "bfloat16", 2),
    ("tiny-gpt2", "float32", 2),
    ("tiny-deepseek-v2", "float32", 2), ("tiny-deepseek-v2-qlora", "float32", 2), ("wide_deepseek", "bfloat16", 2),
    ("tiny-llama", "float32", 4), ("tiny-llama-tied", "float32", 4), ("wide", "bfloat16", 4),
    ("tiny-gpt2", "float32", 4), ("tiny-deepseek-v2", "float32", 4)])
def test_ranks_equal_one(request, tmp_path, name, dtype, world):
    need_gpus(world)
    check_ranks_equal_one(request, tmp_path, name, dtype, world, peer=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v2"])
def test_ranks_through_nccl_alone_equal_one(request, tmp_path, monkeypatch, name):
    """TILEKIT_PEER_ALL_REDUCE_BYTES=0: every all-reduce through NCCL (the path of hosts without peer access)."""
    monkeypatch.setenv("TILEKIT_PEER_ALL_REDUCE_BYTES", "0")
    check_ranks_equal_one(request, tmp_path, name, "float32", 2, peer=False)


def check_ranks_equal_one(request, tmp_path, name: str, dtype: str, world: int, peer: bool) -> None:
    """Every rank holds the same results, equal to one GPU's, having taken the peer path or not as `peer` says."""
    shaped = name.startswith("wide")         # a random checkpoint of a preset's layer shapes
    checkpoint = request.getfixturevalue(name) if shaped else DATA / name
    per_rank = ranks(checkpoint, dtype, tmp_path, world)
    for rank in range(1, world):
        for key in per_rank[0]:
            np.testing.assert_array_equal(per_rank[rank][key], per_rank[0][key], err_msg=f"rank {rank} {key}")
    got = per_rank[0]
    assert bool(got["peer"]) == peer, f"peer memory used: {bool(got['peer'])} (peer access between the GPUs?)"
    one = families.load_model(checkpoint, dtype=dtype)
    ids = np.load(checkpoint / "input_ids.npy") if not shaped else \
        np.random.default_rng(0).integers(0, one.config.vocab_size, (2, 19))
    logits = cupy.asnumpy(one(ids)).astype(np.float64)
    assert rel_err(got["graph"], logits) <= TOL[dtype], rel_err(got["graph"], logits)
    assert rel_err(got["eager"], got["graph"]) <= 1e-6
    if not shaped:
        assert rel_err(got["graph"], np.load(checkpoint / "logits.npy")) <= TOL[dtype]
    np.testing.assert_array_equal(got["greedy_eager"], got["greedy"])
    if dtype == "float32":          # bf16 rounding of the all-reduced sums may flip a near tie: fp32 must agree
        np.testing.assert_array_equal(got["greedy"], np.stack(one.generate(ids, 32, temperature=0, eos_token_id=[])))
        if (checkpoint / "greedy_ids.npy").exists():
            expected = np.load(checkpoint / "greedy_ids.npy")
            np.testing.assert_array_equal(got["greedy"][:, :expected.shape[1]], expected)


@pytest.fixture(scope="module")
def wide_fp8(tmp_path_factory, wide):
    """`wide` quantized to FP8 per channel on one GPU and saved (a compressed-tensors checkpoint)."""
    path = tmp_path_factory.mktemp("wide_fp8")
    families.load_model(wide, quantize="fp8").save_pretrained(path)
    return path


# quantized TP=2 against TP=1 (bf16 activations, 38 rows: weight-only). The same codes and scales: as bf16's
# TOL. Quantized at load: a row-parallel rank's scales are its columns' absmax, so the models differ by up to
# both quantizations' errors (tests/models/llama/test_quantized_tensor_parallel.py; test_quantized's VS_BF16).
QUANTIZED_TOL = {"": TOL["bfloat16"], "int8": 0.05, "fp8": 0.12}


@pytest.mark.parametrize("name, quantize", [("wide_fp8", ""), ("wide", "int8"), ("wide", "fp8")])
def test_two_quantized_ranks_equal_one(request, tmp_path, name, quantize):
    checkpoint = request.getfixturevalue(name)
    per_rank = ranks(checkpoint, "bfloat16", tmp_path, 2, *([quantize] if quantize else []))
    for key in per_rank[0]:
        np.testing.assert_array_equal(per_rank[1][key], per_rank[0][key], err_msg=key)
    one = families.load_model(checkpoint, quantize=quantize or None)
    assert one.quant is not None
    ids = np.random.default_rng(0).integers(0, one.config.vocab_size, (2, 19))
    err = rel_err(per_rank[0]["graph"], cupy.asnumpy(one(ids)).astype(np.float64))
    greedy = np.stack(one.generate(ids, 32, temperature=0, eos_token_id=[]))
    print(f"{name} {quantize or 'as saved'}: TP=2 logits {err:.3g} from TP=1's, greedy agreement "
          f"{np.mean(per_rank[0]['greedy'][:, 19:] == greedy[:, 19:]):.2%}")
    assert err <= QUANTIZED_TOL[quantize]
    assert rel_err(per_rank[0]["eager"], per_rank[0]["graph"]) <= 1e-6
    np.testing.assert_array_equal(per_rank[0]["greedy_eager"], per_rank[0]["greedy"])


def test_a_dead_rank_stops_the_other(tmp_path):
    """Rank 1 dies after joining; rank 0, blocked in an all-reduce that would wait forever (the peer kernel's, its
    4 KB message under the default limit), is stopped by its watchdog with a line naming rank 1 (no launcher here
    to kill it)."""
    import os
    import subprocess
    port = parallel.free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.models.tp_worker", str(DATA / "tiny-llama"),
                               "float32", str(tmp_path), "die"], stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in range(2)]
    try:
        _, err = procs[0].communicate(timeout=100)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == parallel.EXIT_PEER_LOST, err
    assert "rank 0: rank 1 exited without closing the group" in err, err


def test_generate_tp_prints_what_one_gpu_prints(tmp_path):
    """`tilekit generate --tp 2` (rank 0 prints) against one GPU, greedy, on the tiny GPT-2 and its tokenizer."""
    import subprocess
    argv = [sys.executable, "-m", "tilekit", "generate", "--model", str(DATA / "tiny-gpt2"), "--prompt", "the quick",
            "--max-new-tokens", "24", "--temperature", "0", "--dtype", "fp32"]
    one = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    two = subprocess.run(argv + ["--tp", "2"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    assert two.stdout == one.stdout and one.stdout.startswith("the quick")
