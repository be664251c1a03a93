"""benchmarks.studies.load without a GPU: the checkpoint it writes, the order of the loads, the rows and JSON it
writes (the loads themselves faked)."""

import json

import numpy as np
import pytest

from benchmarks.studies import load as bench
from tilekit.models import Llama, LlamaConfig
from tilekit import checkpoints as hf

TINY = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, intermediate_size=24, vocab_size=50,
                   max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture
def tiny(monkeypatch):
    from tilekit.models import families
    monkeypatch.setattr(bench, "model", lambda preset: (families.FAMILIES["llama"], TINY,
                                                        Llama.weights.state_dict_shapes(TINY)))
    monkeypatch.setattr(bench, "SHARD_BYTES", 4000)


def test_the_checkpoint_is_sharded_like_the_hubs_and_loads(tmp_path, tiny):
    bench.write("tiny", tmp_path)
    assert hf.find_checkpoint(tmp_path).config().d["torch_dtype"] == "bfloat16"
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    config, state = Llama.weights.load_state_dict(tmp_path)
    assert config == TINY
    with hf.find_checkpoint(tmp_path).tensor_files() as files:
        assert {t.dtype for t in files.tensors.values()} == {"BF16"}
    assert 0.015 < np.std(state["lm_head.weight"]) < 0.025
    mtime = (tmp_path / "config.json").stat().st_mtime_ns
    bench.write("tiny", tmp_path)                       # written once per preset
    assert (tmp_path / "config.json").stat().st_mtime_ns == mtime


def test_rows_alternate_and_judge_against_hf(tmp_path, tiny, monkeypatch, capsys):
    calls = []
    times = {bench.HF: [1.0, 1.2, 1.1], bench.TILEKIT: [1.3, 1.25, 1.4]}

    def measure(who, directory):
        assert directory == tmp_path / "llama-3.2-1b"
        calls.append(who)
        return {"seconds": times[who][calls.count(who) - 1], "peak_gib": 0.5, "baseline_gib": 2.0}
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench.system, "environment", lambda mode, argv: {"gpu": {"name": "fake"}, "argv": argv})
    argv = ["--preset", "llama-3.2-1b", "--dir", str(tmp_path), "--out", str(tmp_path / "out")]
    assert bench.main(argv) == 0
    assert calls == [bench.HF, bench.TILEKIT, bench.TILEKIT, bench.HF, bench.HF, bench.TILEKIT]
    out, err = capsys.readouterr()
    rows = out.splitlines()
    assert rows[0].startswith("load llama-3.2-1b   HF from_pretrained") and "   1.10 s   1.00x HF" in rows[0]
    assert rows[1].startswith("load llama-3.2-1b   tilekit from_pretrained")
    assert rows[1].endswith("   1.30 s   1.18x HF  peak RSS + 0.50 GiB (baseline 2.00 GiB)  meets #31")
    assert rows[2].startswith("  #31 bounds: time <= 1.32 s, peak RSS <= ")
    assert rows[-1] == "median of 3, alternating order, fresh processes, page cache warm"
    assert "[load llama-3.2-1b] HF from_pretrained: 1.00 s" in err
    saved = json.loads((tmp_path / "out" / "load.json").read_text())
    (result,) = saved["results"]
    assert saved["gpu"] == {"name": "fake"} and saved["reps"] == 3 and result["meets_31"]
    assert result["median"][bench.TILEKIT]["seconds"] == 1.3 and len(result["runs"][bench.HF]) == 3


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--preset", "llama-9"])
    assert info.value.code == 2 and "--preset llama-9: not a preset" in capsys.readouterr().err
