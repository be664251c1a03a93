"""next_token's launch plan on the CPU: candidate slots per chunk, the bound on a row's candidate tile, and the
rows its tuning benchmark samples."""

import math

import pytest

from tilekit.autotune.space import pow2_ceil
from tilekit.kernels.next_token import MAX_SLOTS, NEXT_TOKEN, TILE_SLOTS, _bench_rows, candidate_slots


@pytest.mark.parametrize("top_ks, slots", [([], 0), ([0, 0], 0), ([1], 16), ([14], 16), ([15], 32), ([16], 32),
                                           ([50], 64), ([50, 40, 0], 64), ([56], 64), ([57], 128), ([64], 128),
                                           ([200], 256), ([256], 256), ([300], MAX_SLOTS)])
def test_slots_per_chunk_are_a_power_of_two_with_room_for_ties_above_the_largest_k(top_ks, slots):
    assert candidate_slots(top_ks) == slots


@pytest.mark.parametrize("V", [1031, 32000, 50257, 128256, 151936])
@pytest.mark.parametrize("KS", [16, 32, 64, 128, 256])
def test_candidate_tile_stays_within_the_bound_where_the_vocabulary_allows(V, KS):
    problem = NEXT_TOKEN.tuning_problem(dict(dtype="bfloat16", B=8, V=V, pen=0, KS=KS, check=0))
    fewest = pow2_ceil(-(-V // 8192)) * KS
    candidates = NEXT_TOKEN.space.candidates(problem)
    assert candidates and NEXT_TOKEN.space.contains(NEXT_TOKEN.default(problem))
    for c in candidates:
        assert pow2_ceil(-(-V // c["CH"])) * KS <= max(TILE_SLOTS, fewest), c
    if fewest <= TILE_SLOTS:
        assert any(pow2_ceil(-(-V // c["CH"])) * KS <= TILE_SLOTS for c in candidates)


def test_hf_default_sampling_at_gpt2_and_llama_vocabularies_fills_at_most_2048_slots():
    for V in (50257, 128256):
        problem = NEXT_TOKEN.tuning_problem(dict(dtype="bfloat16", B=1, V=V, pen=0, KS=candidate_slots([50]), check=0))
        assert pow2_ceil(-(-V // NEXT_TOKEN.default(problem)["CH"])) * 64 <= 2048


@pytest.mark.parametrize("KS, check, pen", [(0, 0, 0), (64, 0, 0), (0, 1, 1), (256, 1, 1)])
def test_the_tuning_benchmark_samples_what_its_key_names(KS, check, pen):
    B = 3
    fparams, iparams = _bench_rows(dict(B=B, KS=KS, check=check, pen=pen))
    assert len(fparams) == 6 * B and len(iparams) == 4 * B
    sampled = bool(KS or check)
    for b in range(B):
        inv_t, top_p, log_min_p, rep, pres, freq = fparams[6 * b:6 * b + 6]
        sample, top_k, eos_from, seed = iparams[4 * b:4 * b + 4]
        assert sample == int(sampled) and top_k == KS * 3 // 4 and (top_k == 0 or candidate_slots([top_k]) == KS)
        assert (top_p < 1) == sampled and inv_t == (1.25 if sampled else 1.0) and log_min_p == -math.inf
        assert rep == (1.2 if pen else 1.0) and pres == freq == 0 and eos_from == 0 and seed == b
    assert NEXT_TOKEN.tune_whole
