"""tilekit.engine.sampling and stops: parameters, generation_config.json, the float64 reference sampler, stop rules.

The reference is held against brute-force restatements of Hugging Face's processors (sort-based, one row at a
time) on fresh random, tie-free logits; ties are tested on their own.
"""

import json
import math
import os

import numpy as np
import pytest

from tests._threads import run_briefly
from tilekit.engine.sampling import GenerationSettings, kept_mask, param_arrays, per_row, probabilities, process_logits, sample_reference, SamplingParams, token_counts
from tilekit.engine.stops import StopChecker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")


# -- SamplingParams ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("temperature", "0.7"), ("temperature", None),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True), ("top_k", "5"), ("top_k", 2 ** 32 + 5), ("top_k", 10 ** 30),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan), ("top_p", False),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.2), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("presence_penalty", math.inf), ("presence_penalty", math.nan), ("presence_penalty", True),
    ("frequency_penalty", -math.inf), ("frequency_penalty", "1"),
])
def test_sampling_params_refuse_bad_values_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_sampling_params_normalise_and_accept_numpy_scalars():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(7), top_p=1, min_p=None)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.5, 7, 1.0, 0.0)
    assert type(p.top_k) is int and type(p.top_p) is float
    assert SamplingParams(top_k=None) == SamplingParams(top_k=0)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2.5).presence_penalty == -2.0   # any finite value


def test_per_row_and_param_arrays():
    a, b = SamplingParams(temperature=0), SamplingParams(top_k=3, top_p=0.5)
    assert per_row(a, 3) == (a, a, a)
    assert per_row([a, b], 2) == (a, b)
    for bad in ([a], [a, b, a], [a, "b"], "ab", None):
        with pytest.raises(ValueError, match="one per row"):
            per_row(bad, 2)
    arrays = param_arrays([a, b])
    assert arrays["top_k"].dtype == np.int64 and arrays["top_p"].dtype == np.float64
    np.testing.assert_array_equal(arrays["temperature"], [0.0, 1.0])
    np.testing.assert_array_equal(arrays["top_k"], [0, 3])
    assert set(arrays) == {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty"}


# -- the reference against brute force -----------------------------------------------------------------

def hf_row(logits, seen, output_counts, p: SamplingParams, eos_masked):
    """One row as Hugging Face's processors compute it, restated with sorts: the processed scores."""
    s = logits.astype(np.float64).copy()
    for t in set(seen):                                          # RepetitionPenaltyLogitsProcessor
        s[t] = s[t] * p.repetition_penalty if s[t] < 0 else s[t] / p.repetition_penalty
    for t, n in enumerate(output_counts):                        # vLLM's presence / frequency penalties
        if n:
            s[t] -= p.frequency_penalty * n + p.presence_penalty
    s[list(eos_masked)] = -np.inf                                # MinNewTokensLengthLogitsProcessor
    if p.temperature == 0:
        out = np.full_like(s, -np.inf)
        out[np.argmax(s)] = s[np.argmax(s)]
        return out
    s = s / p.temperature                                        # TemperatureLogitsWarper
    if p.top_k:                                                  # TopKLogitsWarper
        k = min(p.top_k, s.size)
        s[s < np.sort(s)[::-1][k - 1]] = -np.inf
    if p.top_p < 1:                                              # TopPLogitsWarper
        order = np.argsort(s)                                    # ascending
        sorted_probs = np.exp(s[order] - s.max())
        cumulative = np.cumsum(sorted_probs / sorted_probs.sum())
        remove = cumulative <= 1 - p.top_p
        remove[-1] = False
        s[order[remove]] = -np.inf
    if p.min_p:                                                  # MinPLogitsWarper
        probs = np.exp(s - s.max())
        probs /= probs.sum()
        s[probs < p.min_p * probs.max()] = -np.inf
    return s


def random_params(rng) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.6])),
        top_k=int(rng.choice([0, 1, 5, 20, 200])),
        top_p=float(rng.choice([1.0, 0.95, 0.6, 0.2])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
        presence_penalty=float(rng.choice([0.0, 0.5, -0.4])),
        frequency_penalty=float(rng.choice([0.0, 0.3])))


def test_process_logits_matches_hugging_face_restated():
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    for trial in range(40):
        B, V = int(rng.integers(1, 6)), int(rng.integers(2, 120))
        logits = rng.standard_normal((B, V)) * rng.choice([0.5, 3.0])
        prompts = [rng.integers(0, V, rng.integers(1, 8)).tolist() for _ in range(B)]
        outputs = [rng.integers(0, V, rng.integers(0, 6)).tolist() for _ in range(B)]
        counts = token_counts([p + o for p, o in zip(prompts, outputs)], V)
        out_counts = token_counts(outputs, V)
        params = [random_params(rng) for _ in range(B)]
        eos = tuple(rng.choice(V, size=min(V - 1, 2), replace=False).tolist())
        generated, min_new = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        got = process_logits(logits, counts, out_counts, params, generated, eos_token_ids=eos,
                             min_new_tokens=min_new)
        for b in range(B):
            want = hf_row(logits[b], prompts[b] + outputs[b], out_counts[b], params[b],
                          eos if generated < min_new else ())
            msg = f"seed {seed} trial {trial} row {b} {params[b]}"
            np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(want), err_msg=msg)
            np.testing.assert_allclose(got[b][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-12,
                                       err_msg=msg)


def test_penalties_change_exactly_the_tokens_seen():
    rng = np.random.default_rng()
    V = 50
    logits = rng.standard_normal((1, V))
    prompt, output = [3, 3, 7], [7, 11, 11, 11]
    counts, out_counts = token_counts([prompt + output], V), token_counts([output], V)
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)
    got = process_logits(logits, counts, out_counts, p, 0)[0]
    unseen = np.setdiff1d(np.arange(V), [3, 7, 11])
    np.testing.assert_array_equal(got[unseen], logits[0, unseen])       # temperature 1, nothing else on

    def rep(x):
        return x * 1.5 if x < 0 else x / 1.5
    assert got[3] == pytest.approx(rep(logits[0, 3]))                    # prompt only: repetition penalty only
    assert got[7] == pytest.approx(rep(logits[0, 7]) - 0.5 - 0.25)
    assert got[11] == pytest.approx(rep(logits[0, 11]) - 3 * 0.5 - 0.25)
    neg = np.full((1, 4), -2.0)
    assert process_logits(neg, np.ones((1, 4)), np.zeros((1, 4)), SamplingParams(repetition_penalty=2), 0)[0, 0] \
        == -4.0                                                          # a negative score is multiplied


def test_greedy_is_the_argmax_of_the_penalised_logits():
    logits = np.array([[1.0, 3.0, 2.9, 0.0], [5.0, 5.0, 1.0, 1.0]])
    counts = token_counts([[1], []], 4)
    z = process_logits(logits, counts, np.zeros_like(counts), SamplingParams(temperature=0, repetition_penalty=2,
                                                                          top_k=1, top_p=0.1), 0)
    np.testing.assert_array_equal(kept_mask(z), [[0, 0, 1, 0], [1, 0, 0, 0]])   # 3.0 / 2 < 2.9; first of a tie
    assert z[0, 2] == 2.9
    np.testing.assert_array_equal(sample_reference(z, np.random.default_rng()), [2, 0])


def test_ties_are_kept_together():
    p = np.array([0.4, 0.2, 0.2, 0.2, 0.0])
    logits = np.log(np.where(p > 0, p, 1e-300))[None]
    zeros = np.zeros_like(logits)
    keep = kept_mask(process_logits(logits, zeros, zeros, SamplingParams(top_k=2), 0))[0]
    np.testing.assert_array_equal(keep, [1, 1, 1, 1, 0])           # all three at the 2nd-largest score
    keep = kept_mask(process_logits(logits, zeros, zeros, SamplingParams(top_p=0.5), 0))[0]
    np.testing.assert_array_equal(keep, [1, 1, 1, 1, 0])           # 0.4 above each 0.2, < 0.5: all kept
    keep = kept_mask(process_logits(logits, zeros, zeros, SamplingParams(top_p=0.4), 0))[0]
    np.testing.assert_array_equal(keep, [1, 0, 0, 0, 0])
    for order in ([1, 2, 3], [3, 2, 1]):                           # HF keeps a subset, whatever its tie order
        hf = np.zeros(5, bool)
        hf[[0, order[0]]] = True
        assert (keep | hf)[hf].all()
    keep = kept_mask(process_logits(logits, zeros, zeros, SamplingParams(min_p=0.5), 0))[0]
    np.testing.assert_array_equal(keep, [1, 1, 1, 1, 0])           # 0.2 >= 0.5 * 0.4


def test_min_new_tokens_masks_every_eos_until_reached():
    logits = np.zeros((2, 6))
    zeros = np.zeros_like(logits)
    for generated in range(4):
        keep = kept_mask(process_logits(logits, zeros, zeros, SamplingParams(), generated,
                                        eos_token_ids=(1, 4), min_new_tokens=3))
        assert not keep[:, [1, 4]].any() if generated < 3 else keep.all()


def test_bad_inputs_are_refused():
    zeros = np.zeros((2, 4))
    with pytest.raises(ValueError, match="finite or -inf"):
        process_logits(np.array([[0, np.nan, 0, 0]] * 2), zeros, zeros, SamplingParams(), 0)
    with pytest.raises(ValueError, match="shape"):
        process_logits(zeros, np.zeros((2, 5)), zeros, SamplingParams(), 0)
    with pytest.raises(ValueError, match="eos_token_ids must lie in"):
        process_logits(zeros, zeros, zeros, SamplingParams(), 0, eos_token_ids=(4,), min_new_tokens=1)
    with pytest.raises(ValueError, match=r"rows \[1\] have no token left"):
        process_logits(np.array([[0, 0, 0, 0], [-np.inf, 0, -np.inf, -np.inf]]), zeros, zeros, SamplingParams(), 0,
                       eos_token_ids=(1,), min_new_tokens=1)


def test_sample_reference_follows_the_processed_softmax():
    """Frequencies of 200k draws within 5 standard errors of each kept token's probability; removed tokens
    never drawn."""
    rng = np.random.default_rng()
    B, V, n = 3, 12, 200_000
    logits = rng.standard_normal((B, V)) * 2
    zeros = np.zeros_like(logits)
    z = process_logits(logits, zeros, zeros, [SamplingParams(top_k=6), SamplingParams(top_p=0.8, temperature=0.5),
                                              SamplingParams(min_p=0.1)], 0)
    prob = probabilities(z)
    draws = np.stack([sample_reference(z, rng) for _ in range(n)])
    for b in range(B):
        freq = np.bincount(draws[:, b], minlength=V) / n
        assert (freq[~kept_mask(z)[b]] == 0).all()
        se = np.sqrt(prob[b] * (1 - prob[b]) / n)
        assert (np.abs(freq - prob[b]) <= 5 * se + 1e-12).all(), (freq, prob[b])


def test_sample_reference_never_draws_a_removed_token_at_the_top_of_the_cdf():
    class One:                                   # the largest uniform below 1
        def random(self, n):
            return np.full(n, np.nextafter(1.0, 0.0))
    z = np.array([[0.0, 0.0, -np.inf, -np.inf]])
    assert sample_reference(z, One())[0] == 1


# -- GenerationSettings and generation_config.json -----------------------------------------------------

def write(tmp_path, obj) -> str:
    (tmp_path / "generation_config.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(tmp_path)


def test_settings_from_files_that_transformers_wrote():
    gpt2 = GenerationSettings.from_generation_config(os.path.join(DATA, "tiny-gpt2"), config_eos=1030)
    assert gpt2.eos_token_ids == (1030,) and gpt2.sampling.greedy and gpt2.max_new_tokens is None
    llama = GenerationSettings.from_generation_config(os.path.join(DATA, "tiny-llama"), config_eos=257)
    assert llama.eos_token_ids == (257, 258)


def test_settings_follow_hugging_face_precedence(tmp_path):
    none = GenerationSettings.from_generation_config(tmp_path, config_eos=[5, 6, 5])
    assert none.eos_token_ids == (5, 6) and none.sampling == SamplingParams(temperature=0, top_k=50)
    s = GenerationSettings.from_generation_config(
        write(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2],
                         "max_new_tokens": 64, "min_new_tokens": 2, "stop_strings": "\n\n", "max_length": 20,
                         "presence_penalty": 1.0, "unknown": {"nested": [1]}}), config_eos=9)
    assert s.eos_token_ids == (1, 2) and s.stop_strings == ("\n\n",)        # the file's eos win over config.json
    assert (s.max_new_tokens, s.min_new_tokens) == (64, 2)
    assert s.sampling == SamplingParams(temperature=0.6, top_k=50, top_p=0.9)   # HF's top_k default; no penalty
    greedy = GenerationSettings.from_generation_config(write(tmp_path, {"temperature": 0.6, "top_k": 10,
                                                                        "eos_token_id": None}), config_eos=9)
    assert greedy.sampling.greedy and greedy.eos_token_ids == (9,)           # no do_sample: greedy; null: absent
    explicit = greedy.override(temperature=0.8, top_p=None, max_new_tokens=5, eos_token_ids=3, seed=7)
    assert explicit.sampling == SamplingParams(temperature=0.8, top_k=10)    # the file's top_k stays
    assert (explicit.max_new_tokens, explicit.eos_token_ids, explicit.seed) == (5, (3,), 7)
    assert greedy.override(top_k=0).sampling.top_k == 0
    with pytest.raises(ValueError, match="unknown generation argument.*do_sample"):
        greedy.override(do_sample=True)
    with pytest.raises(ValueError, match="top_p"):
        greedy.override(top_p=2.0)


@pytest.mark.parametrize("field,value", [
    ("do_sample", "yes"), ("do_sample", 1), ("temperature", "hot"), ("temperature", -1), ("temperature", True),
    ("top_k", 1.5), ("top_k", True), ("top_k", -2), ("top_p", 0), ("top_p", 7), ("min_p", 2),
    ("repetition_penalty", 0), ("repetition_penalty", [1]), ("max_new_tokens", -3), ("max_new_tokens", 1.0),
    ("min_new_tokens", "2"), ("eos_token_id", -1), ("eos_token_id", [1, "2"]), ("eos_token_id", [True]),
    ("eos_token_id", {"a": 1}), ("eos_token_id", list(range(2000))), ("stop_strings", [""]),
    ("stop_strings", 5), ("stop_strings", ["x" * 5000]), ("stop_strings", ["a"] * 100),
    ("temperature", 10 ** 400),
])
def test_generation_config_fields_are_checked(tmp_path, field, value):
    d = write(tmp_path, {"do_sample": True, field: value})
    with pytest.raises(ValueError) as e:
        GenerationSettings.from_generation_config(d)
    msg = str(e.value)
    assert "generation_config.json" in msg and field in msg and len(msg) < 400


def test_generation_config_messages_escape_control_characters(tmp_path):
    with pytest.raises(ValueError) as e:
        GenerationSettings.from_generation_config(write(tmp_path, {"do_sample": "\u001b[2J\u0007"}))
    assert "\x1b" not in str(e.value) and "\x07" not in str(e.value) and "\\x1b" in str(e.value)


def test_config_json_eos_is_checked(tmp_path):
    with pytest.raises(ValueError, match="config.json: eos_token_id"):
        GenerationSettings.from_generation_config(tmp_path, config_eos=[1, -1])


@pytest.mark.parametrize("text", ['{"temperature": NaN}', '{"top_p": Infinity}', '{"a": 1, "a": 2}', "[1]",
                                  "{", b"\xff\xfe{}"])
def test_generation_config_must_be_strict_json(tmp_path, text):
    path = tmp_path / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationSettings.from_generation_config(tmp_path)


def test_hostile_generation_config_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    path = ckpt / "generation_config.json"
    with open(path, "wb") as f:                      # sparse: larger than any config file, cheap to make
        f.truncate(64 << 20)
    with pytest.raises(ValueError, match="larger than"):
        GenerationSettings.from_generation_config(ckpt)
    path.unlink()
    os.mkfifo(path)
    error = run_briefly(lambda: GenerationSettings.from_generation_config(ckpt))
    assert isinstance(error, ValueError) and "not a regular file" in str(error)
    path.unlink()
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"do_sample": true}')
    path.symlink_to(outside)
    with pytest.raises(ValueError, match=f"generation_config.json: resolves to {outside}, outside {ckpt}"):
        GenerationSettings.from_generation_config(ckpt)
    path.unlink()
    path.symlink_to(ckpt / "missing.json")
    with pytest.raises(FileNotFoundError, match="generation_config.json: is a broken link"):
        GenerationSettings.from_generation_config(ckpt)
    path.unlink()
    path.mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        GenerationSettings.from_generation_config(ckpt)
    path.rmdir()
    (ckpt / "real.json").write_text('{"do_sample": true, "temperature": 0.5}')
    path.symlink_to("real.json")                      # a link that stays inside is fine
    assert GenerationSettings.from_generation_config(ckpt).sampling.temperature == 0.5


def test_hub_snapshot_links_into_blobs_are_inside(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"eos_token_id": 4}')
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "generation_config.json").symlink_to("../../blobs/abc123")
    assert GenerationSettings.from_generation_config(snap).eos_token_ids == (4,)


def test_settings_constructor_checks():
    for kwargs, name in [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(min_new_tokens=True), "min_new_tokens"),
                         (dict(min_new_tokens=2 ** 40), "min_new_tokens"),
                         (dict(seed=-1), "seed"), (dict(seed=2 ** 64), "seed"), (dict(seed=1.0), "seed"),
                         (dict(eos_token_ids=(1, None)), "eos_token_ids"), (dict(stop_strings=("a", 1)), "stop"),
                         (dict(sampling={"temperature": 0}), "sampling")]:
        with pytest.raises(ValueError, match=name):
            GenerationSettings(**kwargs)


# -- StopChecker -----------------------------------------------------------------------------------------

def test_rows_stop_independently_on_any_eos_and_max_new_tokens():
    stop = StopChecker(3, GenerationSettings(max_new_tokens=4, eos_token_ids=(7, 9)))
    steps = [[1, 9, 2], [7, 1, 2], [5, 5, 2], [5, 5, 2], [5, 5, 2]]
    seen = []
    for tokens in steps[:4]:
        assert not stop.all_done
        stop.update(tokens)
        seen.append(stop.done.copy())
    np.testing.assert_array_equal(seen, [[0, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(stop.lengths, [2, 1, 4])     # the eos token is kept
    assert stop.all_done
    stop.update(steps[4])
    np.testing.assert_array_equal(stop.lengths, [2, 1, 4])     # stopped rows ignore further tokens


def test_zero_new_tokens_is_done_and_max_new_tokens_is_needed():
    assert StopChecker(2, GenerationSettings(max_new_tokens=0)).all_done
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopChecker(2, GenerationSettings())


def test_stop_strings_as_hugging_face_matches_them():
    def run(pieces_per_step, stop_strings):
        stop = StopChecker(1, GenerationSettings(max_new_tokens=100, stop_strings=stop_strings))
        for n, piece in enumerate(pieces_per_step, 1):
            stop.update([0], [piece])
            if stop.all_done:
                return n
        return None
    assert run(["st", "op"], ("stop",)) == 2
    assert run(["stop"], ("stop",)) == 1
    assert run(["st", "opera"], ("stop",)) == 2            # a token running past the stop string
    assert run(["s", "to", "pped"], ("stop",)) == 3
    assert run(["las", "topper"], ("stop",)) == 2
    assert run(["s", "", "t", "", "op"], ("stop",)) == 5    # '' while a character is held back
    assert run(["a", "b", "c"], ("stop", "x")) is None
    assert run(["héllo 🌍", " w", "orld"], ("🌍 world",)) == 3
    assert run(["ab", "cd"], ("bc", "abcd")) == 2


def test_stop_checker_checks_its_inputs():
    stop = StopChecker(2, GenerationSettings(max_new_tokens=3))
    with pytest.raises(ValueError, match="shape"):
        stop.update([1, 2, 3])


def test_stop_strings_need_pieces():
    stop = StopChecker(2, GenerationSettings(max_new_tokens=3, stop_strings="x"))
    with pytest.raises(ValueError, match="piece"):
        stop.update([1, 2])
    with pytest.raises(ValueError, match="piece"):
        stop.update([1, 2], ["a"])
