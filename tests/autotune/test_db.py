"""The tuning database on CPU: round trips, layered and nearest lookups, and damaged or stale files."""

import contextlib
import json
import os
import warnings

import pytest

from tests._autotune_fakes import B200, DEFAULT, H100, H100_PCIE, H200, entry, make_op, problem
from tilekit.autotune import store
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import STALE_SPACE
from tilekit.autotune.space import SearchSpace
from tilekit.autotune.db import SCHEMA_VERSION, TuningDB, TuningDBError, TuningDBWarning, device_file_name, dumps
from tilekit.device import DeviceInfo


@pytest.fixture(autouse=True)
def shipped(tmp_path, monkeypatch):
    """An empty shipped layer of our own (never the repository's tuning_db/), writable for setup."""
    root = tmp_path / "shipped"
    root.mkdir()
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(root))
    monkeypatch.delenv("TILEKIT_AUTOTUNE", raising=False)
    store.reset()
    return TuningDB(root, "shipped", writable=True)


@contextlib.contextmanager
def tuning_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got: list[str] = []
        yield got
    got.extend(str(w.message) for w in caught if issubclass(w.category, TuningDBWarning))


def key_of(op, **kw):
    return op.problem_key(problem(**kw))[1]


def user_file(device=H100):
    return store.user_db().file_for(device).path


# -- round trips -----------------------------------------------------------------------------

def test_store_then_lookup_exact():
    op = make_op()
    key = key_of(op, M=1000)
    assert key == f"{op.name}/M=1024,N=768,dtype=bfloat16"
    store.user_db().store(H100, {key: entry(op, {"A": 4, "occupancy": 2})})

    path = user_file()
    assert path == store.user_dir() / "tuning" / "sm_90" / "NVIDIA_H100_80GB_HBM3.json"
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA_VERSION and data["device"] == H100.as_dict()
    assert list(data["entries"]) == [key]

    for M in (513, 1000, 1024):   # every M of the bucket
        r = op.resolve(problem(M=M), H100)
        assert (r.source, r.config) == ("user", {"A": 4, "occupancy": 2})
        assert (r.match.layer, r.match.device_rule, r.match.rule) == ("user", "exact-gpu", "exact")
        assert r.describe() == "user db, exact-gpu, exact bucket"
    r = op.resolve(problem(M=1000), H100, mode="off")
    assert (r.source, r.config, r.describe()) == ("default", DEFAULT, "heuristic default")


def test_merge_keeps_other_entries_and_replaces_same_key():
    op = make_op()
    db = store.user_db()
    db.store(H100, {key_of(op, M=64): entry(op, {"A": 1, "occupancy": 1})})
    db.store(H100, {key_of(op, M=128): entry(op, {"A": 2, "occupancy": 1})})
    db.store(H100, {key_of(op, M=64): entry(op, {"A": 4, "occupancy": 1})})
    entries = db.file_for(H100).read()
    assert {k: e["config"]["A"] for k, e in entries.items()} == {key_of(op, M=64): 4, key_of(op, M=128): 2}
    assert db.file_for(H100).remove({key_of(op, M=64)}) == 1
    assert list(db.file_for(H100).read()) == [key_of(op, M=128)]


def test_rewrites_of_the_same_size_are_seen():
    """The per-file cache must notice a rewrite even when size and (coarse) mtime are unchanged."""
    op = make_op()
    db, key = store.user_db(), key_of(op)
    db.store(H100, {key: entry(op, {"A": 1, "occupancy": 1})})
    assert op.resolve(problem(), H100).config["A"] == 1
    before = user_file().stat()
    for i in range(30):
        a = (2, 1)[i % 2]
        db.store(H100, {key: entry(op, {"A": a, "occupancy": 1})})
        if i == 0:   # what a file system with coarse timestamps does to two quick writes
            os.utime(user_file(), ns=(before.st_atime_ns, before.st_mtime_ns))
            assert user_file().stat().st_size == before.st_size
        assert op.resolve(problem(), H100).config["A"] == a


def test_a_lookup_reads_the_keys_of_its_own_op_once_per_read_of_a_file(monkeypatch):
    """A file's entries are indexed by op once per read: a lookup ranks only its op's keys, checked and parsed the
    first time; a changed file is read and indexed again."""
    from tilekit.autotune import db
    op, other = make_op(), make_op()
    store.user_db().store(H100, {**{key_of(op, M=m): entry(op, DEFAULT) for m in (64, 128)},
                                 **{key_of(other, M=m): entry(other, DEFAULT) for m in (64, 128, 256)}})
    indexed, check = [], db.entry_problem
    monkeypatch.setattr(db, "entry_problem", lambda key, e: indexed.append(key) or check(key, e))
    assert op.resolve(problem(M=100), H100).match.key == key_of(op, M=128)
    assert sorted(indexed) == [key_of(op, M=128), key_of(op, M=64)]
    assert op.resolve(problem(M=60), H100).match.key == key_of(op, M=64) and len(indexed) == 2
    store.user_db().store(H100, {key_of(op, M=32): entry(op, DEFAULT)})
    assert op.resolve(problem(M=30), H100).match.key == key_of(op, M=32)
    assert sorted(indexed[2:]) == [key_of(op, M=128), key_of(op, M=32), key_of(op, M=64)]


def test_nearest_bucket_in_log_space():
    op = make_op()
    store.user_db().store(H100, {key_of(op, M=1024): entry(op, {"A": 1, "occupancy": 2}),
                                 key_of(op, M=8192): entry(op, {"A": 4, "occupancy": 2})})
    r = op.resolve(problem(M=2048), H100)   # log2 distances 1 and 2
    assert r.config["A"] == 1 and r.match.rule == "nearest bucket" and r.match.key == key_of(op, M=1024)
    assert r.describe() == "user db, exact-gpu, nearest bucket (M=1024,N=768,dtype=bfloat16)"
    assert op.resolve(problem(M=3000), H100).config["A"] == 4     # bucket 4096: distances 2 and 1
    assert op.resolve(problem(M=1), H100).config["A"] == 1
    assert op.resolve(problem(M=10**6), H100).config["A"] == 4
    # Another N is a nearest shape (below), another dtype is never borrowed.
    assert op.resolve(problem(M=1024, N=1024), H100).match.rule == "nearest shape"
    assert op.resolve(problem(M=1024, dtype="float16"), H100).source == "default"


def test_exact_gpu_before_same_arch_before_nothing():
    op = make_op()
    key = key_of(op)
    store.user_db().store(H100, {key: entry(op, {"A": 4, "occupancy": 1})})
    store.user_db().store(H100_PCIE, {key: entry(op, {"A": 2, "occupancy": 1}, device=H100_PCIE)})

    r = op.resolve(problem(), H100)
    assert r.config["A"] == 4 and r.match.device_rule == "exact-gpu"
    r = op.resolve(problem(), H100_PCIE)
    assert r.config["A"] == 2 and r.match.device_rule == "exact-gpu"
    r = op.resolve(problem(), H200)   # no file of its own: another GPU of the same compute capability
    assert r.match.device_rule == "same-arch (NVIDIA_H100_80GB_HBM3)" and r.config["A"] == 4
    assert "same-arch (NVIDIA_H100_80GB_HBM3)" in r.describe()
    assert op.resolve(problem(), B200).source == "default"   # another arch is never used


def test_same_arch_when_own_file_lacks_a_compatible_entry():
    op = make_op()
    store.user_db().store(H200, {key_of(op, N=1024): entry(op, {"A": 4, "occupancy": 1}, device=H200)})
    store.user_db().store(H100_PCIE, {key_of(op): entry(op, {"A": 2, "occupancy": 2}, device=H100_PCIE)})
    r = op.resolve(problem(), H200)
    assert r.config == {"A": 2, "occupancy": 2}
    assert r.match.device_rule == "same-arch (NVIDIA_H100_PCIe)" and r.match.rule == "exact"


def test_other_arch_file_never_used(shipped):
    op = make_op()
    store.user_db().store(B200, {key_of(op): entry(op, {"A": 4, "occupancy": 1}, device=B200)})
    shipped.store(B200, {key_of(op): entry(op, {"A": 4, "occupancy": 1}, device=B200)})
    assert op.resolve(problem(), H100).source == "default"
    assert op.resolve(problem(), B200).config["A"] == 4


def test_user_layer_over_shipped_layer(shipped):
    op = make_op()
    key = key_of(op)
    shipped.store(H100, {key: entry(op, {"A": 2, "occupancy": 2})})
    r = op.resolve(problem(), H100)
    assert (r.source, r.config["A"]) == ("shipped", 2)
    assert r.describe() == "shipped db, exact-gpu, exact bucket"

    store.user_db().store(H100, {key: entry(op, {"A": 4, "occupancy": 2})})
    r = op.resolve(problem(), H100)
    assert (r.source, r.config["A"], r.match.layer) == ("user", 4, "user")
    assert r.describe() == "user db, exact-gpu, exact bucket"

    assert store.user_db().file_for(H100).remove() == 1
    assert op.resolve(problem(), H100).source == "shipped"
    with pytest.raises(PermissionError):
        store.shipped_db().store(H100, {key: entry(op, {"A": 4, "occupancy": 2})})


def test_layer_dirs_follow_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "ship2"))
    (tmp_path / "ship2").mkdir()
    store.reset()
    user, shipped_db = store.layers()
    assert (user.layer, user.writable, user.root) == ("user", True, tmp_path / "elsewhere" / "tuning")
    assert (shipped_db.layer, shipped_db.writable, shipped_db.root) == ("shipped", False, tmp_path / "ship2")
    assert device_file_name(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3.json"
    assert device_file_name("A/B:C") == "A_B_C.json"


# -- damaged files ---------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "empty", "not-an-object", "no-schema", "garbage"])
def test_corrupt_file_is_one_warning_then_moved_aside(damage):
    op = make_op()
    db = store.user_db()
    db.store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    path = user_file()
    text = path.read_bytes()
    bad = {"truncated": text[: len(text) // 2], "empty": b"", "not-an-object": b"[1, 2]\n",
           "no-schema": b'{"entries": {}}', "garbage": b"\x00\xff\xfe not json"}[damage]
    path.write_bytes(bad)

    with tuning_warnings() as got:
        for _ in range(3):
            assert op.resolve(problem(), H100).source == "default"
            assert db.lookup(op.name, problem(), H100, op.buckets, lambda k, e: None) is None
        store.reset()   # a fresh process-level view does not warn again either
        assert op.resolve(problem(), H100).source == "default"
    assert len(got) == 1, got
    assert str(path) in got[0] and "ignoring tuning file" in got[0]
    assert path.read_bytes() == bad   # reading never rewrites

    with tuning_warnings() as got:
        store.user_db().store(H100, {key_of(op, M=64): entry(op, {"A": 2, "occupancy": 1})})
    assert len(got) == 1 and "moved it to" in got[0], got
    (aside,) = path.parent.glob("*.bad")
    assert aside.read_bytes() == bad
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA_VERSION and list(data["entries"]) == [key_of(op, M=64)]
    assert op.resolve(problem(M=64), H100).config == {"A": 2, "occupancy": 1}


def test_two_corrupt_files_in_a_row_are_both_kept():
    op = make_op()
    db = store.user_db()
    path = user_file()
    for i in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"broken {i}")
        with tuning_warnings():
            db.store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    assert sorted(p.read_text() for p in path.parent.glob("*.bad")) == ["broken 0", "broken 1", "broken 2"]


def test_corrupt_entries_are_skipped_others_still_work():
    op = make_op()
    good = entry(op, {"A": 2, "occupancy": 2})
    store.user_db().store(H100, {
        key_of(op, M=1024): good,
        key_of(op, M=2048): {**good, "time_us": "fast"},
        key_of(op, M=4096): {**good, "config": [2, 2]},
        key_of(op, M=8192): "not an entry",
        key_of(op, M=16384): {k: v for k, v in good.items() if k != "kernel_hash"},
        f"{op.name}/garbage": good,
        f"{op.name}/M=x,N=768,dtype=bfloat16": good,
    })
    with tuning_warnings() as got:
        for _ in range(2):
            for M in (2048, 4096, 8192, 16384):
                r = op.resolve(problem(M=M), H100)
                assert r.config == good["config"]
                assert r.match.describe().endswith("nearest bucket (M=1024,N=768,dtype=bfloat16)")
            assert op.resolve(problem(M=1024), H100).match.exact
    joined = "\n".join(got)
    for M in (2048, 4096, 8192, 16384):
        assert f"{key_of(op, M=M)} " in joined
    assert f"{op.name}/garbage" in joined
    assert len(got) == len(set(got)) == 5, got   # each problem once


def test_other_schema_version_is_ignored_then_moved_aside():
    op = make_op()
    path = user_file()
    path.parent.mkdir(parents=True)
    original = json.dumps({"schema": SCHEMA_VERSION + 1, "device": H100.as_dict(),
                           "entries": {key_of(op): entry(op, {"A": 4, "occupancy": 1})}})
    path.write_text(original)
    with tuning_warnings() as got:
        assert op.resolve(problem(), H100).source == "default"
        assert op.resolve(problem(), H100).source == "default"
    assert len(got) == 1 and f"schema version {SCHEMA_VERSION + 1}" in got[0], got

    with tuning_warnings() as got:
        store.user_db().store(H100, {key_of(op, M=64): entry(op, {"A": 2, "occupancy": 1})})
    assert len(got) == 1 and "moved it to" in got[0]
    (aside,) = path.parent.glob("*.bad")
    assert aside.read_text() == original
    assert json.loads(path.read_text())["schema"] == SCHEMA_VERSION


def test_unreadable_layout_is_a_miss_not_an_exception():
    op = make_op()
    root = store.user_db().root
    root.mkdir(parents=True)
    (root / "sm_90").write_text("a file where the arch directory should be")
    (root / "sm_100").mkdir()
    (root / "sm_100" / "NVIDIA_B200.json").mkdir()   # a directory named like a device file
    with tuning_warnings():
        assert op.resolve(problem(), H100).source == "default"
        assert op.resolve(problem(), B200).source == "default"


# -- entries this kernel may not use ---------------------------------------------------------

@pytest.mark.parametrize("field, why", [("kernel_hash", "another version of the kernel source"),
                                        ("space_hash", "another search space")])
def test_stale_hash_is_not_used(field, why, shipped):
    op = make_op()
    stale = entry(op, {"A": 4, "occupancy": 1}, **{field: "0123456789abcdef"})
    for db in (store.user_db(), shipped):
        db.store(H100, {key_of(op): stale})
    with tuning_warnings() as got:
        assert op.resolve(problem(), H100).source == "default"
    assert len(got) == 2 and all("stale" in m and why in m for m in got), got
    assert {m.split()[3] for m in got} == {"user", "shipped"}

    # a usable neighbour is still found
    store.user_db().store(H100, {key_of(op, M=2048): entry(op, {"A": 2, "occupancy": 1})})
    with tuning_warnings():
        r = op.resolve(problem(), H100)
    assert r.config["A"] == 2 and r.match.rule == "nearest bucket"


def test_changed_kernel_source_invalidates():
    from tests._autotune_fakes import other_kernel_body
    op = make_op()
    store.user_db().store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    op2 = make_op(func=other_kernel_body)
    assert op2.kernel_hash() != op.kernel_hash()
    key2 = key_of(op2)
    store.user_db().store(H100, {key2: entry(op, {"A": 4, "occupancy": 1})})   # op's hash, op2's key
    with tuning_warnings() as got:
        assert op2.resolve(problem(), H100).source == "default"
    assert any("stale" in m for m in got)
    assert op.resolve(problem(), H100).source == "user"


def test_other_toolchain_stale_in_user_layer_but_fine_when_shipped(shipped):
    op = make_op()
    old = entry(op, {"A": 4, "occupancy": 2}, toolchain={"cuda_tile": "0.0.1", "tileiras": "1.0.0"})
    store.user_db().store(H100, {key_of(op): old})
    with tuning_warnings() as got:
        assert op.resolve(problem(), H100).source == "default"
    assert len(got) == 1 and "stale" in got[0] and "0.0.1" in got[0], got

    shipped.store(H100, {key_of(op): old})
    with tuning_warnings():
        r = op.resolve(problem(), H100)
    assert (r.source, r.config) == ("shipped", {"A": 4, "occupancy": 2})


@pytest.mark.parametrize("config", [{"A": 3, "occupancy": 1}, {"A": 2.0, "occupancy": 1}, {"A": 2},
                                    {"A": 2, "occupancy": 1, "B": 1}, {"A": True, "occupancy": 1},
                                    {"A": "2", "occupancy": 1}, {}])
def test_config_outside_space_is_rejected(config):
    op = make_op()
    store.user_db().store(H100, {key_of(op): entry(op, config)})
    with tuning_warnings() as got:
        r = op.resolve(problem(), H100)
    assert (r.source, r.config) == ("default", DEFAULT)
    assert len(got) == 1 and f"config outside the {op.name} search space" in got[0], got


def test_exact_shipped_beats_a_distant_user_guess(shipped):
    op = make_op()
    shipped.store(H100, {key_of(op, M=8192): entry(op, {"A": 4, "occupancy": 2})})
    store.user_db().store(H100_PCIE, {key_of(op, M=16): entry(op, {"A": 1, "occupancy": 1}, device=H100_PCIE)})
    r = op.resolve(problem(M=8192), H100)
    assert r.describe() == "shipped db, exact-gpu, exact bucket"


# -- untuned shapes: the nearest tuned shape of the same op, dtype and flags ----------------------

def fits_a(c, p):
    """A config of A tiles fits rows of at least 256 A."""
    return c["A"] * 256 <= p["N"]


SHAPED = dict(key=dict(dtype=None, M=pow2_bucket, N=None, K=None, act=None), choices=dict(act=("none", "gelu")),
              space=SearchSpace(fits_a, A=(1, 2, 4), occupancy=(1, 2)))


def shaped(M=1024, N=2048, K=4096, act="none", dtype="bfloat16"):
    return {"dtype": dtype, "M": M, "N": N, "K": K, "act": act}


def store_shaped(op, db=None, device=H100, **configs):
    """configs: 'M_N_K_act' -> A (occupancy 1)."""
    updates = {}
    for name, a in configs.items():
        M, N, K, act = name.split("_")
        updates[op.problem_key(shaped(int(M), int(N), int(K), act))[1]] = entry(op, {"A": a, "occupancy": 1}, device)
    (db or store.user_db()).store(device, updates)


def test_the_sizes_of_a_key_are_its_fields_without_choices():
    assert make_op(**SHAPED).sizes == {"M", "N", "K"}
    assert make_op().sizes == {"M", "N"}


def test_rules_in_order_exact_then_nearest_bucket_then_nearest_shape():
    op = make_op(**SHAPED)
    store_shaped(op, **{"1024_4096_4096_none": 1, "16_2048_4096_none": 2})
    r = op.resolve(shaped(M=1024), H100)   # M=16 is 6 buckets away, still before another N
    assert (r.config["A"], r.match.rule) == (2, "nearest bucket")
    store_shaped(op, **{"1024_2048_4096_none": 4})
    r = op.resolve(shaped(M=1000), H100)
    assert (r.config["A"], r.match.rule, r.describe()) == (4, "exact", "user db, exact-gpu, exact bucket")
    r = op.resolve(shaped(M=4096, N=3000), H100)  # no entry of N=3000: the nearest N (4096 beats 2048)
    assert (r.config["A"], r.match.rule) == (1, "nearest shape")
    assert r.describe() == "user db, exact-gpu, nearest shape (K=4096,M=1024,N=4096,act=none,dtype=bfloat16)"
    assert op.resolve(shaped(K=64), H100).source == "user"   # K is a size too
    assert op.resolve(shaped(), H100, mode="off").describe() == "heuristic default"


def test_nearest_shape_is_nearest_in_the_unbucketed_sizes_then_in_the_buckets():
    op = make_op(**SHAPED)
    store_shaped(op, **{"8192_4096_4096_none": 1, "1024_8192_4096_none": 2})
    r = op.resolve(shaped(M=1024, N=2048), H100)   # N one octave away at M 8x off beats N two octaves away
    assert r.config["A"] == 1 and r.match.distance == (2, 1.0, 3.0)
    store_shaped(op, **{"1_4096_4096_none": 2})     # the same N, M 10 octaves away: M decides between them
    assert op.resolve(shaped(M=1024, N=2048), H100).config["A"] == 1
    assert op.resolve(shaped(M=2, N=2048), H100).config["A"] == 2


@pytest.mark.parametrize("reverse", [False, True])
def test_ties_are_broken_by_the_key(reverse):
    op = make_op(**SHAPED)
    configs = {"1024_1024_4096_none": 1, "1024_4096_4096_none": 2}    # N=2048 lies one octave from both
    store_shaped(op, **dict(reversed(configs.items())) if reverse else configs)
    r = op.resolve(shaped(N=2048), H100)
    assert r.match.key == op.problem_key(shaped(N=1024))[1] and r.config["A"] == 1


def test_another_dtype_or_flag_is_never_borrowed():
    op = make_op(**SHAPED)
    store_shaped(op, **{"1024_2048_4096_gelu": 2})
    assert op.resolve(shaped(act="none"), H100).source == "default"
    assert op.resolve(shaped(act="none", N=4096), H100).source == "default"
    assert op.resolve(shaped(act="gelu", dtype="float16"), H100).source == "default"
    assert op.resolve(shaped(act="gelu", N=4096), H100).config["A"] == 2
    other = make_op(**SHAPED)            # nor another op's entries
    assert other.resolve(shaped(act="gelu"), H100).source == "default"


def test_a_borrowed_config_that_does_not_fit_is_skipped():
    op = make_op(**SHAPED)
    store_shaped(op, **{"1024_1024_4096_none": 4, "1024_256_4096_none": 1})
    r = op.resolve(shaped(N=512), H100)    # A=4 needs N >= 1024: the next nearest shape instead
    assert r.config == {"A": 1, "occupancy": 1} and r.match.key == op.problem_key(shaped(N=256))[1]
    assert op.resolve(shaped(N=2048), H100).config["A"] == 4
    store.user_db().file_for(H100).remove({op.problem_key(shaped(N=256))[1]})
    store_shaped(op, **{"1024_512_4096_none": 2})    # nothing that fits N=300: the default
    assert op.resolve(shaped(N=300), H100).source == "default"
    # the nearest bucket is checked too: the op's default, used for its own key where the rule refuses it (the tuner
    # times it too), fits no other problem the rule refuses it for
    store_shaped(op, **{"64_200_4096_none": 1})
    assert op.resolve(shaped(N=200, M=128), H100).source == "default"
    assert op.resolve(shaped(N=200, M=64), H100).match.key == op.problem_key(shaped(N=200, M=64))[1]


def test_a_config_the_rule_refuses_for_its_own_key_is_invalid_unless_it_is_the_default():
    """An exact entry is checked against the space's rule for its key too: a config of the space's values that the
    rule refuses there is a broken entry (tuned over another space: stale), except the op's default for the key,
    which the tuner times too."""
    from tilekit.autotune.entries import entry_reason
    op = make_op(**SHAPED)
    key, refused = op.problem_key(shaped(N=512))[1], {"A": 4, "occupancy": 1}     # A=4 needs N >= 1024
    why = f"config the {op.name} search space's rule refuses for its key"
    assert entry_reason(key, entry(op, refused), "user") == why
    assert entry_reason(key, entry(op, refused, space_hash="0" * 16), "user") == STALE_SPACE
    assert entry_reason(op.problem_key(shaped(N=200))[1], entry(op, DEFAULT), "user") is None    # A=1 needs N >= 256
    store_shaped(op, **{"1024_512_4096_none": 4, "1024_1024_4096_none": 2})
    with tuning_warnings() as got:
        r = op.resolve(shaped(N=512), H100)
    assert (r.config["A"], r.match.rule) == (2, "nearest shape")
    assert len(got) == 1 and "rule refuses for its key" in got[0], got


def test_a_config_the_op_does_not_lend_serves_only_its_own_key():
    op = make_op(**SHAPED, borrowable=lambda c: c["occupancy"] == 1)
    store_shaped(op, **{"1024_4096_4096_none": 2})                        # occupancy 1: lent
    key = op.problem_key(shaped(N=2048))[1]
    store.user_db().store(H100, {key: entry(op, {"A": 4, "occupancy": 2})})  # the nearest shape, not lent
    assert op.resolve(shaped(N=2048), H100).config == {"A": 4, "occupancy": 2}          # its own key: used
    r = op.resolve(shaped(N=3000), H100)                  # 2048 is nearer than 4096, but not lent
    assert r.config == {"A": 2, "occupancy": 1} and r.match.rule == "nearest shape"
    assert op.resolve(shaped(M=64, N=2048), H100).config == {"A": 2, "occupancy": 1}    # nor to another bucket


def test_validity_is_judged_on_the_bucketed_problem():
    seen = []
    op = make_op(key=SHAPED["key"], choices=SHAPED["choices"],
                 space=SearchSpace(lambda c, p: seen.append(dict(p)) or True, A=(1, 2, 4), occupancy=(1, 2)))
    store_shaped(op, **{"1024_1024_4096_none": 4})
    assert op.resolve(shaped(M=1000, N=2000), H100).config["A"] == 4
    assert seen == [shaped(M=1024, N=1024), shaped(M=1024, N=2000)]     # the entry's own key's, then the call's


def test_a_far_bucket_after_another_gpus_near_one_before_any_nearest_shape(shipped):
    """The own GPU's config of the same N and K tuned more than BUCKET_REACH buckets away (M=128 for M=8192) yields
    to another GPU of the arch holding the exact key or a near bucket, but still wins over every nearest shape."""
    op = make_op(**SHAPED)
    store_shaped(op, device=H100, **{"128_2048_4096_none": 1, "8192_4096_4096_none": 4})
    store_shaped(op, db=shipped, device=H200, **{"8192_2048_4096_none": 2})
    r = op.resolve(shaped(M=8192), H100)
    assert (r.config["A"], r.match.device_rule, r.match.rule) == (2, "same-arch (NVIDIA_H200)", "exact")
    r = op.resolve(shaped(M=4096), H100)         # the other GPU's bucket one octave away
    assert (r.config["A"], r.match.rule) == (2, "nearest bucket")
    r = op.resolve(shaped(M=1024), H100)         # 3 octaves from both: the own GPU's first
    assert (r.config["A"], r.match.device_rule) == (1, "exact-gpu")
    r = op.resolve(shaped(M=8192), H200)         # its own exact key
    assert (r.source, r.config["A"]) == ("shipped", 2)
    r = op.resolve(shaped(M=8192, N=2050), H100)   # no N=2050 anywhere: the nearest shape, own GPU first
    assert (r.config["A"], r.match.rule) == (1, "nearest shape")
    store.user_db().file_for(H100).remove()
    store_shaped(op, device=H100, **{"128_2048_4096_none": 1, "8192_4096_4096_none": 4})
    shipped.file_for(H200).remove()
    r = op.resolve(shaped(M=8192), H100)         # alone, the far bucket still beats the nearer-M shape
    assert (r.config["A"], r.match.rule) == (1, "nearest bucket")


def test_any_gpu_of_the_arch_before_a_nearest_shape_then_own_gpu_first(shipped):
    op = make_op(**SHAPED)
    store_shaped(op, device=H100_PCIE, **{"1024_2048_4096_none": 2})
    store_shaped(op, device=H100, **{"1024_8192_4096_none": 1, "1024_16384_4096_none": 4})
    r = op.resolve(shaped(), H100)   # another GPU's exact key before the own GPU's nearest shape
    assert (r.config["A"], r.match.device_rule, r.match.rule) == (2, "same-arch (NVIDIA_H100_PCIe)", "exact")
    r = op.resolve(shaped(N=16000), H100_PCIE)   # the own GPU's nearest shape before a closer one elsewhere
    assert (r.config["A"], r.match.device_rule, r.match.rule) == (2, "exact-gpu", "nearest shape")
    r = op.resolve(shaped(N=16000), H200)        # no file of its own: the nearest shape of the same-arch files
    assert (r.config["A"], r.match.device_rule) == (4, "same-arch (NVIDIA_H100_80GB_HBM3)")
    assert op.resolve(shaped(N=16000), B200).source == "default"

    store_shaped(op, db=shipped, device=H200, **{"1024_16384_4096_none": 1})
    r = op.resolve(shaped(N=16000), H200)        # the shipped file of its own, over the user's other GPU
    assert (r.source, r.config["A"], r.match.device_rule) == ("shipped", 1, "exact-gpu")
    store_shaped(op, db=shipped, device=H100, **{"1024_4096_4096_none": 2})
    r = op.resolve(shaped(N=5000), H100)    # the closer shape wins across layers ...
    assert (r.source, r.config["A"]) == ("shipped", 2)
    store_shaped(op, device=H100, **{"1024_4096_4096_none": 1})
    r = op.resolve(shaped(N=5000), H100)    # ... and the user layer only breaks a tie
    assert (r.source, r.config["A"]) == ("user", 1)


def test_stale_entries_are_not_borrowed():
    op = make_op(**SHAPED)
    key = op.problem_key(shaped(N=4096))[1]
    store.user_db().store(H100, {key: entry(op, {"A": 4, "occupancy": 1}, kernel_hash="0123456789abcdef")})
    with tuning_warnings() as got:
        assert op.resolve(shaped(), H100).source == "default"
    assert len(got) == 1 and "stale" in got[0]


# -- untrusted files: paths, strict JSON, the read-only shipped layer, file modes, leftovers ----

@pytest.mark.parametrize("arch, name", [("/abs/sm_90", H100.name), ("../../shipped/sm_90", H100.name),
                                        ("sm_90/..", H100.name), ("sm_90\n", H100.name), ("sm_٩٠", H100.name),
                                        ("sm_90", ".."), ("sm_90", "."), ("sm_90", "///"), ("sm_90", ""),
                                        ("sm_90", "../.hidden"), ("sm_90", "x" * 1000)])
def test_no_path_from_arch_or_name(arch, name, tmp_path):
    op = make_op()
    with pytest.raises(ValueError, match="sm_<digits>|makes no usable file name"):
        store.user_db().store(DeviceInfo(name, arch, 132), {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    assert not store.user_dir().exists()
    assert device_file_name("A/../B") == "A_.._B.json"   # slashes never survive


def test_strict_json_in_and_out():
    op = make_op()
    with pytest.raises(ValueError):
        store.user_db().store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1}, time_us=float("nan"))})
    assert not user_file().exists() and not list(user_file().parent.glob("*.tmp"))   # no file, no leftover
    store.user_db().store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    good = user_file().read_text()
    for literal in ("NaN", "Infinity", "-Infinity", "1e400"):
        user_file().write_text(good.replace('"time_us":10.0', f'"time_us":{literal}'))
        store.reset()
        with tuning_warnings() as got:
            assert op.resolve(problem(), H100).source == "default"
        assert len(got) == 1 and "not strict JSON" in got[0], got


def test_header_must_match_the_path():
    op = make_op()
    store.user_db().store(H200, {key_of(op): entry(op, {"A": 4, "occupancy": 1}, device=H200)})
    user_file().parent.joinpath(device_file_name(H200.name)).rename(user_file())   # H200's file as the H100's
    with tuning_warnings() as got:
        assert op.resolve(problem(), H100).source == "default"
    assert len(got) == 1 and "does not match its path" in got[0], got


def test_shipped_layer_is_never_written(shipped):
    """Reading a corrupt shipped file warns and moves nothing; every write refuses; bytes stay."""
    op = make_op()
    shipped.store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    path = shipped.file_for(H100).path
    path.write_text("corrupt")
    path.with_name("NVIDIA_H200.json.1.bad").write_text("moved aside long ago")
    before = sorted((p.name, p.read_bytes()) for p in path.parent.iterdir())
    read_only = store.shipped_db()
    with tuning_warnings() as got:
        assert op.resolve(problem(), H100).source == "default"
        assert list(read_only.items()) == []
    assert len(got) == 1 and "ignoring tuning file" in got[0]
    for write in (lambda: read_only.store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})}),
                  lambda: read_only.file_for(H100).remove(), lambda: read_only.file_for(H100).remove({"x"}),
                  lambda: read_only.clear(moved_aside=True)):
        with pytest.raises(PermissionError, match="shipped tuning database .* is read-only"):
            write()
    assert sorted((p.name, p.read_bytes()) for p in path.parent.iterdir()) == before


def test_symlinks_out_of_the_root_are_refused(tmp_path):
    op = make_op()
    outside = tmp_path / "outside"
    TuningDB(outside, "user", writable=True).store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    snapshot = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    root = store.user_db().root
    root.mkdir(parents=True)
    (root / "sm_90").symlink_to(outside / "sm_90")             # an arch directory that escapes
    with tuning_warnings() as got:
        assert op.resolve(problem(), H100).source == "default"
    assert len(got) == 1 and "resolves outside the database root" in got[0], got
    with pytest.raises(TuningDBError, match="resolves outside the database root"):
        store.user_db().store(H100, {key_of(op): entry(op, {"A": 1, "occupancy": 1})})

    (root / "sm_90").unlink()
    (root / "sm_90").mkdir()
    user_file().symlink_to(outside / "sm_90" / user_file().name)   # a device file that escapes
    store.reset()
    with tuning_warnings():
        assert op.resolve(problem(), H100).source == "default"
    assert "resolves outside the database root" in store.user_db().file_for(H100).load()[1]
    with tuning_warnings() as got:   # a write moves the link aside (never its target) and starts afresh
        store.user_db().store(H100, {key_of(op, M=64): entry(op, {"A": 1, "occupancy": 1})})
    assert len(got) == 1 and "moved it to" in got[0]
    assert not user_file().is_symlink() and list(store.user_db().file_for(H100).read()) == [key_of(op, M=64)]
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == snapshot


def test_file_mode_follows_the_umask():
    op = make_op()
    for umask, mode in ((0o022, 0o644), (0o002, 0o664), (0o077, 0o600)):
        old = os.umask(umask)
        try:
            store.user_db().store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
        finally:
            os.umask(old)
        assert user_file().stat().st_mode & 0o777 == mode, oct(user_file().stat().st_mode)


def test_temporary_files_of_killed_writers_are_removed_by_the_next_writer():
    op = make_op()
    db = store.user_db()
    db.store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    directory = user_file().parent
    mine = [directory / f".{user_file().name}.{suffix}.tmp" for suffix in ("k2j4_x9a", "0123456789abcdef")]
    theirs = directory / ".NVIDIA_H200.json.abcdefgh.tmp"   # another file's writer may be alive: not ours
    for p in mine + [theirs]:
        p.write_text("half a file")
    db.store(H100, {key_of(op, M=64): entry(op, {"A": 2, "occupancy": 1})})
    assert not any(p.exists() for p in mine) and theirs.exists()
    assert len(db.file_for(H100).read()) == 2


def test_clear_removes_files_and_leftovers_keeps_locks_and_asks_for_moved_aside():
    op = make_op()
    db = store.user_db()
    db.store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    db.store(H200, {key_of(op): entry(op, {"A": 4, "occupancy": 1}, device=H200)})
    directory = user_file().parent
    (directory / ".NVIDIA_B300.json.abcdefgh.tmp").write_text("a killed first write")
    (directory / "NVIDIA_H200.json.123.bad").write_text("moved aside")
    assert db.clear() == 2
    assert sorted(p.name for p in directory.iterdir()) == [
        "NVIDIA_B300.json.lock", "NVIDIA_H100_80GB_HBM3.json.lock", "NVIDIA_H200.json.123.bad",
        "NVIDIA_H200.json.lock"]
    assert db.clear(moved_aside=True) == 0
    assert not list(directory.glob("*.bad"))


def test_an_unusable_cache_dir_is_one_clear_error(tmp_path, monkeypatch):
    op = make_op()
    (tmp_path / "cachefile").write_text("not a directory")
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "cachefile"))
    store.reset()
    assert store.user_db().root_problem() == f"{tmp_path / 'cachefile'} is not a directory"
    with pytest.raises(TuningDBError, match=f"cannot write {user_file()}: {tmp_path / 'cachefile'} is not a dir"):
        store.user_db().store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    with tuning_warnings():
        assert op.resolve(problem(), H100).source == "default"   # reads: a miss


# -- entry_reason: the one rule for dispatch, import and verify ------------------------------

@pytest.mark.parametrize("change, reason", [
    (dict(), None),
    (dict(key="nosuchkernel/M=1024,N=768,dtype=bfloat16"), "unknown kernel 'nosuchkernel'"),
    (dict(key="{op}/garbage"), "malformed tuning key '{op}/garbage'"),
    (dict(key="{op}/M=1000,N=768,dtype=bfloat16"), "key is not a {op} problem key"),   # not a bucket
    (dict(key="{op}/M=x,N=768,dtype=bfloat16"), "key is not a {op} problem key"),
    (dict(config={"A": -1, "occupancy": 1}), "config outside the {op} search space"),
    (dict(config={"A": 3, "occupancy": 1}), "config outside the {op} search space"),
    (dict(config={"A": "4", "occupancy": 1}), "config outside the {op} search space"),
    (dict(config={"A": 1e30, "occupancy": 1}), "config outside the {op} search space"),
    (dict(time_us=float("nan")), "time_us is not finite"),
    (dict(time_us=float("inf")), "time_us is not finite"),
    (dict(time_us=-1.0), "time_us is negative"),
    (dict(time_us=True), "time_us is not a number"),
    (dict(default_time_us=float("-inf")), "default_time_us is not finite"),
    (dict(default_time_us="slow"), "default_time_us is not a number"),
    (dict(default_time_us=None), None),
    (dict(time_us="fast"), "field 'time_us' missing or of the wrong type"),
    (dict(kernel_hash="0" * 16), "stale: tuned for another version of the kernel source"),
    (dict(space_hash="0" * 16), "stale: tuned over another search space"),
    # a config the space has since dropped: stale (tune --stale re-tunes it), not a broken entry
    (dict(config={"A": 3, "occupancy": 1}, space_hash="0" * 16), "stale: tuned over another search space"),
    (dict(config={"A": 3, "occupancy": 1}, kernel_hash="0" * 16, space_hash="0" * 16), "stale: tuned for another"),
])
def test_entry_reason(change, reason):
    from tilekit.autotune.entries import entry_reason
    op = make_op()
    key = change.pop("key", key_of(op)).format(op=op.name)
    e = entry(op, change.pop("config", {"A": 4, "occupancy": 1}), **change)
    got = entry_reason(key, e, "user")
    assert got == reason if reason is None else got.startswith(reason.format(op=op.name)), got
    db = store.user_db()   # and lookup with it as the rule sees the same
    store.user_db().file_for(H100).path.parent.mkdir(parents=True, exist_ok=True)
    db.file_for(H100).path.write_text(json.dumps({"schema": SCHEMA_VERSION, "device": H100.as_dict(),
                                                  "entries": {key: e}}))
    with tuning_warnings():
        found = db.lookup(op.name, problem(), H100, op.buckets, lambda k, e: entry_reason(k, e, "user"))
    assert (found is None) == (reason is not None or key != key_of(op))


def test_a_user_database_inside_the_shipped_one_is_never_written(tmp_path, monkeypatch):
    from tests._autotune_fakes import make_op
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "both"))
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "both"))        # user root: both/tuning
    (tmp_path / "both").mkdir()
    store.reset()
    op = make_op()
    with pytest.raises(Exception, match="read-only"):
        store.user_db().store(H100, {key_of(op): entry(op, {"A": 4, "occupancy": 1})})
    assert not any((tmp_path / "both").rglob("*.json"))


def test_a_database_file_is_one_compact_entry_per_line():
    data = {"schema": 1, "device": {"name": "GPU", "arch": "sm_90"},
            "entries": {"op/M=2": {"config": {"A": 4}, "time_us": 1.5}, "op/M=1": {"config": {"A": 2}, "time_us": 2.0}}}
    text = dumps(data)
    assert json.loads(text) == data
    lines = text.splitlines()
    assert '  "op/M=1": {"config":{"A":2},"time_us":2.0},' in lines
    assert '  "op/M=2": {"config":{"A":4},"time_us":1.5}' in lines
    assert json.loads(dumps({**data, "entries": {}}))["entries"] == {}
    with pytest.raises(ValueError):
        dumps({**data, "entries": {"op/M=1": {"time_us": float("nan")}}})
