"""tilekit.parallel's processes: torchrun's variables checked (errors name the variable), the rendezvous (a wrong
world size or a missing rank is an error on every rank, within a timeout), the watchdog (a rank that dies makes
the others exit, even ones that would wait forever), the launcher (a dying rank stops the others), and the peer
all-reduce's memory (the ranks agree to use it or all fall back to NCCL, on a fake CUDA runtime)."""

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tilekit import env, parallel
from tilekit.env import Distributed
from tilekit.untrusted import quoted

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


def test_unset_means_one_process():
    assert env.distributed() is None


def test_torchrun_variables_are_read(monkeypatch):
    for name, value in zip(TORCHRUN, ("3", "4", "1", "node7", "29500")):
        monkeypatch.setenv(name, value)
    assert env.distributed() == Distributed(3, 4, 1, "node7", 29500)


@pytest.mark.parametrize("values, message", [
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="1"), r"MASTER_ADDR unset"),
    (dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), r"RANK=2 is not below WORLD_SIZE=2"),
    (dict(RANK="0", WORLD_SIZE="zwei", MASTER_ADDR="h", MASTER_PORT="1"), r"WORLD_SIZE='zwei' is not an integer"),
    (dict(RANK="0", WORLD_SIZE="0", MASTER_ADDR="h", MASTER_PORT="1"), r"WORLD_SIZE='0' is not an integer in \[1"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="70000"), r"MASTER_PORT='70000'"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h;rm", MASTER_PORT="1"), r"MASTER_ADDR='h;rm' is not a host"),
    (dict(RANK="1", LOCAL_RANK="3", WORLD_SIZE="4", MASTER_ADDR="h", MASTER_PORT="1"), r"LOCAL_RANK=3 is above"),
    (dict(RANK="0", WORLD_SIZE="1" * 5000, MASTER_ADDR="h", MASTER_PORT="1"),
     r"^WORLD_SIZE='1{200}'\.\.\. is not an integer in \[1, 65536\]$"),
])
def test_bad_torchrun_variables_are_named(monkeypatch, values, message):
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        env.distributed()
    with pytest.raises(ValueError, match=message):
        env.check()


@pytest.mark.parametrize("addr", ["a..b", "a" * 64, "a" * (1 << 20), "-node", "node-", "[", "[::1", "::1]", "a:b:c",
                                  "1.2.3.4.5", "999.1.1.1", "65536", ".", "node..", "[10.0.0.1]", "h\udcff"])
def test_a_master_addr_that_is_no_host_name_or_address_is_named(monkeypatch, addr):
    """Refused before any socket: a bad label (empty, over 63 characters, a hyphen at an end) made the resolver
    raise UnicodeError, a ValueError naming no variable; the rest only failed to resolve, for RENDEZVOUS_TIMEOUT."""
    for name, value in zip(TORCHRUN, ("1", "2", "1", addr, "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        env.distributed()
    assert str(info.value) == f"MASTER_ADDR={quoted(addr)} is not a host name or address"


@pytest.mark.parametrize("addr, read", [("node7", "node7"), ("Node-7.cluster_a.example", "Node-7.cluster_a.example"),
                                        ("localhost", "localhost"), (" 10.0.0.1 ", "10.0.0.1"), ("::1", "::1"),
                                        ("[fe80::1]", "fe80::1"), ("a" * 63 + ".b", "a" * 63 + ".b"), ("3com", "3com"),
                                        ("node7.example.", "node7.example.")])
def test_master_addr_host_names_and_addresses(monkeypatch, addr, read):
    """A bracketed IPv6 address (as in a URL) loses its brackets, which socket.create_connection does not take."""
    for name, value in zip(TORCHRUN, ("1", "2", "1", addr, "29500")):
        monkeypatch.setenv(name, value)
    assert env.distributed().master_addr == read


def test_splits():
    assert [parallel.span(259, r, 2) for r in range(2)] == [(0, 130), (130, 259)]
    assert [parallel.vocab_span(259, r, 4) for r in range(4)] == [(0, 128), (128, 192), (192, 256), (256, 259)]
    assert [parallel.vocab_span(128256, r, 2) for r in range(2)] == [(0, 64128), (64128, 128256)]
    assert parallel.vocab_span(50257, 1, 2) == (25152, 50257)
    with pytest.raises(ValueError, match=r"vocab_size \(100\) has fewer blocks of 64 than the tensor-parallel size 4"):
        parallel.vocab_span(100, 3, 4)
    assert [parallel.kv_head_span(2, 8, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [parallel.kv_head_span(8, 32, r, 2) for r in range(2)] == [(0, 4), (4, 8)]


def rendezvous(dists, timeout=10.0, payload="id"):
    """Link.connect for each Distributed on its own thread: {rank: Link or the exception}; on_lost records."""
    out, lost = {}, []

    def body(d):
        try:
            out[d.rank] = parallel.Link.connect(d, payload if d.rank == 0 else None, timeout=timeout,
                                                on_lost=lost.append)
        except Exception as e:   # noqa: BLE001 - handed back to the test
            out[d.rank] = e
    threads = [threading.Thread(target=body, args=(d,), daemon=True) for d in dists]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * timeout)
    assert not any(t.is_alive() for t in threads), "hung"
    return out, lost


def test_ranks_meet_and_part():
    port = parallel.free_port()
    links, lost = rendezvous([Distributed(r, 3, r, "127.0.0.1", port) for r in range(3)])
    assert all(link.payload == "id" for link in links.values())
    closers = [threading.Thread(target=links[r].close) for r in range(3)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(20)
    time.sleep(0.6)
    assert lost == []


def test_a_world_size_mismatch_fails_every_rank():
    port = parallel.free_port()
    out, _ = rendezvous([Distributed(0, 2, 0, "127.0.0.1", port), Distributed(1, 3, 1, "127.0.0.1", port)])
    for rank in (0, 1):
        assert isinstance(out[rank], parallel.RankError)
        assert "rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2" in str(out[rank])


@pytest.mark.parametrize("hello, claim", [({"rank": [1], "world_size": 2}, "a rank claims RANK=[1]"),
                                          ({"rank": "\x1b[2J", "world_size": 2}, "a rank claims RANK='\\x1b[2J'"),
                                          ({"rank": 1, "world_size": "\n2"},
                                           "rank 1 has WORLD_SIZE='\\n2' but rank 0 has WORLD_SIZE=2")])
def test_a_strangers_hello_fails_the_rendezvous_with_a_rank_error(hello, claim):
    """Whatever connects to MASTER_PORT is untrusted: a RANK that is no integer (a list raised TypeError on rank 0,
    leaving the caller unanswered) or text with control characters is named, escaped, on rank 0 and to the caller."""
    port = parallel.free_port()
    out = {}
    thread = threading.Thread(target=lambda: out.update(rendezvous([Distributed(0, 2, 0, "127.0.0.1", port)])[0]))
    thread.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with sock:
        sock.sendall(json.dumps(hello).encode() + b"\n")
        assert parallel.rendezvous._receive(sock, time.monotonic() + 10, "stranger") == {"error": claim}
    thread.join(30)
    assert isinstance(out[0], parallel.RankError) and str(out[0]) == f"rank 0: {claim}"


def test_missing_ranks_time_out():
    port = parallel.free_port()
    out, _ = rendezvous([Distributed(0, 3, 0, "127.0.0.1", port), Distributed(2, 3, 2, "127.0.0.1", port)],
                        timeout=1.0)
    assert "rank 0: ranks [1] did not arrive at MASTER_ADDR=127.0.0.1" in str(out[0])
    assert "rank 2: ranks [1] did not arrive" in str(out[2])          # told by rank 0, at once
    out, _ = rendezvous([Distributed(1, 2, 1, "127.0.0.1", parallel.free_port())], timeout=1.0)
    assert "rank 1: rank 0 did not answer at MASTER_ADDR=127.0.0.1" in str(out[1])


def test_a_failing_rank_is_named_on_the_others():
    port = parallel.free_port()
    links, lost = rendezvous([Distributed(r, 2, r, "127.0.0.1", port) for r in range(2)])
    links[1].close(failed="out of memory\n\x1b[2J")         # a peer's text, escaped: one line, no terminal codes
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == ["rank 0: rank 1 failed: out of memory\\n\\x1b[2J"]


RANK_SCRIPT = textwrap.dedent("""
    import sys, time, os
    from tilekit import env, parallel
    link = parallel.Link.connect(env.distributed(), timeout=20)
    if link.dist.rank == 1:
        os._exit(3)          # dies without closing
    time.sleep(60)           # rank 0: as if blocked in a collective
""")


def test_a_dead_rank_makes_the_others_exit():
    """Real processes through the launcher: rank 1 dies; rank 0, which would sleep for a minute, exits at once
    (the watchdog) and the launcher reports the first failure."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from tilekit import parallel
        sys.exit(parallel.launch(2, ["-c", {RANK_SCRIPT!r}], program=[sys.executable], grace=5))
    """)], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert result.returncode in (3, parallel.EXIT_PEER_LOST), result.stderr
    assert "rank 1 exited with status 3" in result.stderr or "rank 0: rank 1 exited without closing" in \
        result.stderr, result.stderr


def test_the_launcher_stops_the_others_when_a_rank_fails():
    start = time.monotonic()
    code = "import os, sys, time\nif os.environ['RANK'] == '2': sys.exit(5)\ntime.sleep(60)"
    assert parallel.launch(3, ["-c", code], program=[sys.executable], grace=5) == 5
    assert time.monotonic() - start < 30


def test_the_launcher_sets_the_ranks_environment(monkeypatch):
    """`env` reaches every rank over this process's environment; torchrun's variables are the launcher's own."""
    monkeypatch.setenv("TILEKIT_TEST_KEPT", "kept")
    code = ("import os, sys\nsys.exit(0 if (os.environ['TILEKIT_TEST_KEPT'], os.environ['TILEKIT_TEST_SET'], "
            "os.environ['WORLD_SIZE']) == ('kept', 'set', '2') else 7)")
    assert parallel.launch(2, ["-c", code], program=[sys.executable], env={"TILEKIT_TEST_SET": "set",
                                                                           "WORLD_SIZE": "9"}) == 0


def test_no_nccl_is_one_clear_error(tmp_path, monkeypatch):
    """CuPy's binding unusable here (no libnccl): the wheel's library is looked for under site-packages/nvidia, and a
    broken one is named."""
    pytest.importorskip("cupy")
    from cupy.cuda import nccl
    if getattr(nccl, "available", False):
        pytest.skip("this host has a working NCCL")
    import importlib.util
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"not a library")
    spec = importlib.util.spec_from_loader("nvidia", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "nvidia")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "nvidia" else None)
    with pytest.raises(RuntimeError, match=r"libnccl.so.2 could not be loaded"):
        parallel.load_nccl()


@pytest.mark.parametrize("payload, expected", [({"id": [0, 1, 255], "bytes": True}, b"\x00\x01\xff"),
                                               ({"id": [-128, 5, 127], "bytes": False}, (-128, 5, 127))])
def test_nccl_unique_id_reaches_the_binding_as_it_came(payload, expected):
    assert parallel.nccl_unique_id(payload) == expected


@pytest.mark.parametrize("payload", [None, [1, 2], {"id": "abc"}, {"id": [1, 256]}, {"id": [True]}, {"id": []}])
def test_a_bad_nccl_unique_id_is_refused(payload):
    with pytest.raises(RuntimeError, match="NCCL unique id"):
        parallel.nccl_unique_id(payload)


def test_holders_are_released_once_and_weakly():
    class Model:
        released = 0

        def forget_graphs(self):
            Model.released += 1
    kept, dropped = Model(), Model()
    comm = parallel.ShapeOnly(0, 2)
    comm.hold(kept.forget_graphs)
    comm.hold(dropped.forget_graphs)
    del dropped                       # a model gone before close() is not kept alive by the communicator
    comm.release_holders()
    comm.release_holders()
    assert Model.released == 1


class _FakeRuntime:
    """cupy.cuda.runtime as PeerMemory calls it, on host integers: allocations are numbers, a handle is the
    allocation's number as bytes; `broken` maps a rank (its thread's name) to the call that fails there."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, broken: dict | None = None):
        self.broken, self.freed, self.closed, self.lock, self.next = broken or {}, [], [], threading.Lock(), 0x1000

    def _maybe_fail(self, call: str):
        if self.broken.get(threading.current_thread().name) == call:
            raise self.CUDARuntimeError(f"{call} failed")

    def malloc(self, size):
        with self.lock:
            self.next += 0x1000
            return self.next

    def memset(self, ptr, value, size):
        pass

    def deviceSynchronize(self):
        pass

    def ipcGetMemHandle(self, ptr):
        return ptr.to_bytes(8, "little") + bytes(56)

    def deviceCanAccessPeer(self, device, peer):
        return int(self.broken.get(threading.current_thread().name) != "peer access")

    def ipcOpenMemHandle(self, handle):
        self._maybe_fail("ipcOpenMemHandle")
        return int.from_bytes(handle[:8], "little") + 1

    def ipcCloseMemHandle(self, ptr):
        self.closed.append(ptr)

    def free(self, ptr):
        self.freed.append(ptr)


def _peer_memories(monkeypatch, world: int, runtime: _FakeRuntime, wrong_sum: str | None = None) -> dict:
    """PeerMemory built by `world` ranks (threads named by rank) on the fake runtime, the kernel's first sum
    replaced (wrong on rank `wrong_sum`); rank -> PeerMemory, after checking none hung or raised."""
    import types
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime), zeros=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(parallel.PeerMemory, "_array", lambda self, ptr, *a, **k: ptr)

    def first_sum(self):
        if threading.current_thread().name == wrong_sum:
            raise RuntimeError("the peer all-reduce's first sum was wrong")
    monkeypatch.setattr(parallel.PeerMemory, "_self_test", first_sum)
    group = parallel.ThreadGroup(world, timeout=20)
    made, errors = {}, []

    def rank(r):
        try:
            made[r] = parallel.PeerMemory(r, world, r, group.communicator(r).all_reduce)
        except BaseException as e:     # noqa: BLE001 - reported below
            errors.append(e)
            group.abort()
    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return made


def test_peer_memory_is_used_only_where_every_rank_can(monkeypatch, capsys):
    """The ranks agree through the group's sums: every peer's memory opened and a right first sum on all, or none
    takes the peer path (a rank on it while another is on NCCL would wait forever); a rank that fails says why, and
    whoever falls back frees what it allocated and unmaps what it opened."""
    monkeypatch.setenv("TILEKIT_PEER_ALL_REDUCE_BYTES", "65536")
    made = _peer_memories(monkeypatch, 3, _FakeRuntime())
    assert [(m.usable, m.limit) for m in made.values()] == [(True, 65536)] * 3
    assert made[0].peers == [1, 2] and made[2].peers == [0, 1]
    assert made[1].opened == {2: made[2].ptr + 1, 0: made[0].ptr + 1}       # each peer's handle, opened
    for broken, wrong, unmapped in [({"1": "ipcOpenMemHandle"}, None, 4), ({"2": "peer access"}, None, 0),
                                    ({}, "0", 6)]:
        runtime = _FakeRuntime(broken)
        made = _peer_memories(monkeypatch, 3, runtime, wrong)
        assert [m.usable for m in made.values()] == [False] * 3, (broken, wrong)
        assert len(runtime.freed) == 3 and len(runtime.closed) == unmapped, (broken, wrong)
        assert all(not m.opened and not m.ptr for m in made.values())
    assert "rank 0: all-reduces go through NCCL only: the peer path failed here (RuntimeError: the peer " \
           "all-reduce's first sum was wrong)" in capsys.readouterr().err


def test_peer_memory_left_off_agrees_on_every_rank_without_allocating(monkeypatch):
    """TILEKIT_PEER_ALL_REDUCE_BYTES=0 (NCCL for all): every rank makes the same setup sums and none takes the peer
    path or allocates anything."""
    monkeypatch.setenv("TILEKIT_PEER_ALL_REDUCE_BYTES", "0")
    runtime = _FakeRuntime()
    made = _peer_memories(monkeypatch, 3, runtime)
    assert [(m.usable, m.limit, m.ptr) for m in made.values()] == [(False, 0, 0)] * 3
    assert runtime.next == 0x1000 and not runtime.freed
