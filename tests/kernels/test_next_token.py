"""next_token on the GPU against its float64 reference: greedy rows are the argmax, sampled rows never leave
the kept set and follow the processed softmax (chi-square at a fixed false-alarm rate), penalties and
the eos ban act exactly where they should, and the draws repeat for a seed, graph or eager."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

Z_1E4 = 3.719        # the standard normal's upper 1e-4 quantile: each chi-square test's false-alarm rate


def chi2_limit(df: int) -> float:
    """The chi-square upper 1e-4 quantile with df degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + Z_1E4 * math.sqrt(2 / (9 * df))) ** 3


def params(rows):
    """(reference params, fparams, iparams) from (temperature, top_k, top_p, min_p, rep, pres, freq, eos_from,
    seed) rows."""
    from tilekit.kernels.next_token import PARAM_NAMES, pack_params
    cols = np.array([r[:7] for r in rows], np.float64).T
    ref = {name: (col.astype(np.int64) if name == "top_k" else col) for name, col in zip(PARAM_NAMES, cols)}
    fp, ip = pack_params(ref, [r[7] for r in rows], [r[8] for r in rows])
    return ref, fp, ip


class State:
    """Device decode state of B rows."""

    def __init__(self, B, L, positions=0):
        import cupy
        self.tokens = cupy.full(B, -7, cupy.int32)
        self.positions = cupy.full(B, positions, cupy.int32)
        self.finished = cupy.zeros(B, cupy.int32)
        self.history = cupy.full((B, L), -7, cupy.int32)


def run(logits, fp, ip, eos, state, *, seen=None, out_counts=None, pad=0, device=None):
    """One next_token call; `device` (fparams, iparams, eos already on the GPU) for calls under graph capture."""
    import cupy

    from tilekit.kernels.next_token import candidate_slots, next_token
    slots = candidate_slots(ip[:, 1][ip[:, 0] != 0])
    check = bool(np.any((ip[:, 0] != 0) & (ip[:, 1] == 0) & (fp[:, 1] < 1)))
    d_fp, d_ip, d_eos = device or (cupy.asarray(fp), cupy.asarray(ip), cupy.asarray(np.asarray(eos, np.int32)))
    next_token(logits, d_fp, d_ip, d_eos, state.tokens, state.positions, state.history, state.finished, seen=seen,
               out_counts=out_counts, slots=slots, check=check, pad=pad)


@pytest.mark.parametrize("dtype,V", [("bfloat16", 50257), ("float32", 1031), ("float16", 128256)])
def test_greedy_rows_take_the_first_argmax_of_the_penalised_logits(dtype, V):
    import cupy

    from tilekit.kernels.checks import host, rand
    from tilekit.kernels.next_token import next_token_reference
    B, eos = 6, [V - 1, 3]
    logits = rand((B, V), dtype, 3.0)
    rng = np.random.default_rng()
    seen = cupy.asarray(rng.integers(0, 3, (B, V)).astype(np.int32))
    out_counts = cupy.asarray(np.minimum(host(seen), rng.integers(0, 2, (B, V))).astype(np.int32))
    rows = [(0, 0, 1.0, 0, r, pr, fr, e, 0) for r, pr, fr, e in
            [(1.0, 0, 0, 0), (1.3, 0, 0, 0), (0.7, 0.5, 0.1, 0), (1.0, 0, 0, 5), (1.1, 0.2, 0.3, 5), (1.0, 0, 0, 0)]]
    ref, fp, ip = params(rows)
    state = State(B, 8, positions=3)
    state.finished[5] = 1
    seen0, out0 = host(seen), host(out_counts)
    z = next_token_reference(host(logits), seen0, out0, ref, ip[:, 2] > 3, eos)
    run(logits, fp, ip, eos, state, seen=seen, out_counts=out_counts, pad=11)
    tokens = host(state.tokens)
    want = np.where(np.arange(B) == 5, 11, z.argmax(1))
    assert tokens.tolist() == want.tolist()
    assert host(state.history)[:, 4].tolist() == want.tolist() and (host(state.history)[:, :4] == -7).all()
    assert host(state.positions).tolist() == [4] * B
    assert host(state.finished).tolist() == [int(t in eos) for t in want[:5]] + [1]
    bumped = np.zeros((B, V), np.int64)
    bumped[np.arange(5), want[:5]] = 1
    assert np.array_equal(host(seen), seen0 + bumped) and np.array_equal(host(out_counts), out0 + bumped)


COMBOS = [  # temperature, top_k, top_p, min_p, repetition, presence, frequency: every path of the kernels
    (0.8, 50, 0.95, 0, 1.0, 0, 0),      # candidates, top-k then top-p
    (1.0, 0, 1.0, 0, 1.0, 0, 0),        # plain sampling
    (1.0, 0, 0.3, 0, 1.0, 0, 0),        # top-p alone: the check pass, often rejected
    (0.7, 0, 1.0, 0.5, 1.0, 0, 0),      # min-p alone, often rejected
    (1.3, 20, 1.0, 0.05, 1.2, 0.3, 0.2),  # top-k and min-p with penalties
    (1.0, 300, 0.9, 0, 1.0, 0, 0),      # a top-k past the candidate slots: the whole-row path
]


def check_sampling(logits, combos, reps, draws, label):
    """Draw `draws` tokens for `reps` rows of each combo on its own logits row (the same penalties every draw):
    every token within the reference's kept set, frequencies within chi-square at 1e-4 of its softmax."""
    import cupy

    from tilekit.kernels.checks import host
    from tilekit.kernels.next_token import next_token_reference
    V = logits.shape[1]
    B = len(combos) * reps
    logits = cupy.repeat(logits, reps, axis=0)
    rng = np.random.default_rng()
    seen_rows = rng.integers(0, 2, (len(combos), V)).astype(np.int32)
    seen = cupy.asarray(np.repeat(seen_rows, reps, axis=0))
    out_counts = seen.copy()
    rows = [(*c, 0, int(rng.integers(1 << 30))) for c in combos for _ in range(reps)]
    ref, fp, ip = params(rows)
    ref_z = next_token_reference(host(logits), host(seen), host(out_counts), ref, np.zeros(B, bool), [-1])
    kept = ref_z > -np.inf
    state = State(B, draws + 2)
    for _ in range(draws):
        seen_before, out_before = seen.copy(), out_counts.copy()   # the same penalties for every draw
        run(logits, fp, ip, [-1], state, seen=seen_before, out_counts=out_before)
    samples = host(state.history)[:, 1:draws + 1]
    for i, combo in enumerate(combos):
        got = samples[i * reps:(i + 1) * reps].ravel()
        keep = kept[i * reps]
        assert keep[got].all(), f"{combo} {label}: tokens outside the kept set: {sorted(set(got[~keep[got]]))[:10]}"
        z = ref_z[i * reps]
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        expected = p * got.size
        observed = np.bincount(got, minlength=V)
        order = np.argsort(expected)[::-1]     # merge the smallest expectations into one bin of >= 5
        big = order[expected[order] >= 5]
        rest = np.setdiff1d(np.flatnonzero(keep), big)
        e = np.append(expected[big], expected[rest].sum())
        o = np.append(observed[big], observed[rest].sum())
        e, o = (e, o) if e[-1] >= 5 else (e[:-1], o[:-1])
        stat = float(((o - e) ** 2 / e).sum())
        df = max(1, len(e) - 1)
        assert stat < chi2_limit(df), f"{combo} {label}: chi-square {stat:.1f} over {df} dof"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sampled_tokens_stay_in_the_kept_set_and_follow_its_softmax(dtype):
    from tilekit.kernels.checks import rand
    check_sampling(rand((len(COMBOS), 3001), dtype, 1.5), COMBOS, 4, 1500, dtype)


def test_tied_scores_keep_the_top_k_and_top_p_sets_exact():
    """Logits on a coarse grid: many tokens tie at the k-th score and at the top-p cut (HF keeps the ties of the
    k-th score); ties past a chunk's slots take the whole-row path."""
    import cupy
    rng = np.random.default_rng()
    logits = cupy.asarray((np.round(rng.standard_normal((4, 3001)) * 2) / 2).astype(np.float32))
    combos = [(1.0, 50, 1.0, 0, 1.0, 0, 0), (0.8, 50, 0.95, 0, 1.0, 0, 0), (1.0, 10, 0.5, 0, 1.0, 0, 0),
              (0.7, 16, 1.0, 0.3, 1.0, 0, 0)]
    check_sampling(logits, combos, 4, 1200, "tied float32")


@pytest.mark.parametrize("top_k", [50, 256])
def test_top_k_over_a_large_vocabulary_within_the_candidate_bound(top_k):
    """Llama's vocabulary: k = 50 fills a 2048-slot candidate tile (32 chunks x 64), k = 256 the fewest slots
    8192-wide chunks allow; both stay exact."""
    from tilekit.kernels.checks import rand
    combos = [(0.8, top_k, 0.95, 0, 1.0, 0, 0), (1.2, top_k, 1.0, 0, 1.1, 0.2, 0)]
    check_sampling(rand((2, 128256), "bfloat16", 2.0), combos, 3, 600, f"V128256 k{top_k}")


def test_same_seed_same_tokens_eager_and_graph():
    import cupy

    from tilekit.kernels.checks import rand
    B, V, steps = 4, 50257, 6
    logits = rand((B, V), "bfloat16", 1.0)
    _, fp, ip = params([(0.8, 50, 0.95, 0, 1.0, 0, 0, 0, 1234), (1.0, 0, 0.9, 0, 1.0, 0, 0, 0, 99),
                     (0.7, 0, 1.0, 0.1, 1.0, 0, 0, 0, 5), (0.0, 0, 1.0, 0, 1.0, 0, 0, 0, 0)])
    runs = []
    for graphed in (False, False, True):
        state = State(B, steps + 2)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            if graphed:
                device = (cupy.asarray(fp), cupy.asarray(ip), cupy.asarray(np.array([-1], np.int32)))
                run(logits, fp, ip, [-1], state, device=device)    # compile and plan outside the capture
                state = State(B, steps + 2)
                stream.begin_capture()
                run(logits, fp, ip, [-1], state, device=device)
                graph = stream.end_capture()
                for _ in range(steps):
                    graph.launch(stream)
            else:
                for _ in range(steps):
                    run(logits, fp, ip, [-1], state)
            stream.synchronize()
        runs.append(cupy.asnumpy(state.history)[:, 1:steps + 1])
    assert np.array_equal(runs[0], runs[1]), "a seed gave different tokens in two runs"
    assert np.array_equal(runs[0], runs[2]), "the captured graph drew other tokens than eager calls"
    assert len(set(runs[0][0].tolist())) > 1, "sampling drew one token six times in a row"


def test_banned_eos_is_never_drawn_until_min_new_tokens():
    import cupy

    from tilekit.kernels.checks import rand
    B, V = 8, 1031
    logits = rand((B, V), "float32", 0.5)
    logits[:, 7] = 50.0                     # eos would win every draw
    _, fp, ip = params([(1.0, 0, 1.0, 0, 1.0, 0, 0, 3, s) for s in range(B)])
    state = State(B, 10)
    for _ in range(5):
        run(logits, fp, ip, [7, -1], state)
    hist = cupy.asnumpy(state.history)
    assert (hist[:, 1:4] != 7).all(), "eos drawn while banned"
    assert (hist[:, 4] == 7).all() and cupy.asnumpy(state.finished).all()
    assert (hist[:, 5] == 0).all(), "a finished row must emit the pad token"


@pytest.mark.parametrize("V", [1031, 128256])
def test_eos_ids_fewer_than_a_power_of_two_leave_token_zero_alone(V):
    """Three eos ids (as Llama 3's instruct checkpoints have) make E = 4: the fourth, absent id is no token, so token
    0 is neither banned under min_new_tokens nor taken for an eos; nor with the engine's 32 eos slots."""
    import cupy

    from tilekit.kernels.checks import rand
    B = 4
    logits = rand((B, V), "float32", 0.5)
    logits[:, 0] = 40.0                      # token 0 wins every greedy pick
    logits[:, 5] = 50.0                      # unless eos 5 is banned
    _, fp, ip = params([(0.0, 0, 1.0, 0, 1.0, 0, 0, 1, 0)] * B)      # greedy, eos banned at position 0
    state = State(B, 6)
    run(logits, fp, ip, [5, V - 1, V - 2], state)
    run(logits, fp, ip, [5, V - 1, V - 2], state)
    assert cupy.asnumpy(state.history)[:, 1:3].tolist() == [[0, 5]] * B, "token 0 taken for an eos or banned"
    assert cupy.asnumpy(state.finished).tolist() == [1] * B
    state = State(B, 4)
    eos32 = [5] + [V - 1 - i for i in range(31)]
    run(logits, fp, ip, eos32, state)
    assert cupy.asnumpy(state.history)[:, 1].tolist() == [0] * B and not cupy.asnumpy(state.finished).any()
