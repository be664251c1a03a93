"""The ranks' rendezvous and watchdog: rank 0 listens at MASTER_ADDR:MASTER_PORT, every rank connects within a
timeout, the world sizes are compared (a mismatch is an error on every rank) and rank 0 hands out a payload (NCCL's
unique id). The connections stay open as a watchdog: a rank whose process dies closes them, and every other rank
then exits with an error naming it, even one blocked inside an NCCL or peer all-reduce kernel that would otherwise
wait forever."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from typing import Callable

from tilekit.env import Distributed
from tilekit.parallel.comm import RankError
from tilekit.untrusted import quoted, shown

RENDEZVOUS_TIMEOUT = 120.0    # seconds for every rank to arrive (model loading happens after)
EXIT_PEER_LOST = 75           # a rank's exit status when another rank died


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _receive(sock: socket.socket, deadline: float, what: str) -> dict:
    """One JSON line from sock before `deadline` (time.monotonic); RankError naming `what` otherwise."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankError(f"{what}: no answer in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except socket.timeout:
            raise RankError(f"{what}: no answer in time") from None
        if not chunk:
            raise RankError(f"{what}: the connection closed (that rank exited)")
        data += chunk
        if len(data) > 1 << 20:
            raise RankError(f"{what}: an oversized message")
    try:
        message = json.loads(data)
    except ValueError:
        raise RankError(f"{what}: a message that is not JSON") from None
    if not isinstance(message, dict):
        raise RankError(f"{what}: a message that is not a JSON object")
    return message


class Link:
    """The ranks' TCP rendezvous at MASTER_ADDR:MASTER_PORT, then their watchdog (see the module doc).

    connect() returns once every rank has arrived with the same WORLD_SIZE; `payload` (rank 0's: e.g. NCCL's
    unique id, any JSON value) reaches every rank as .payload. After it, a rank whose peer's connection drops
    without a goodbye calls on_lost(message) (default: print it and exit the process with EXIT_PEER_LOST)."""

    def __init__(self, dist: Distributed, socks: dict[int, socket.socket], payload, on_lost: Callable[[str], None]):
        self.dist, self.socks, self.payload, self.on_lost = dist, socks, payload, on_lost
        self.closing = False
        self.said_bye: set[int] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, name="tilekit-rank-watchdog", daemon=True)
        self.thread.start()

    @classmethod
    def connect(cls, dist: Distributed, payload=None, *, timeout: float = RENDEZVOUS_TIMEOUT,
                on_lost: Callable[[str], None] | None = None) -> "Link":
        deadline = time.monotonic() + timeout
        where = f"MASTER_ADDR={dist.master_addr} MASTER_PORT={dist.master_port}"
        on_lost = on_lost or _exit_lost
        if dist.rank == 0:
            socks = cls._gather(dist, payload, deadline, where, timeout)
            return cls(dist, socks, payload, on_lost)
        sock = cls._dial(dist, deadline, where, timeout)
        try:
            _send(sock, {"rank": dist.rank, "world_size": dist.world_size})
            # rank 0 answers by its own deadline, which may come up to `timeout` after ours (it may have started
            # later): wait that long too, so that a missing rank is reported as rank 0 saw it
            reply = _receive(sock, deadline + timeout, f"rank {dist.rank}: rendezvous with rank 0 at {where}")
        except BaseException:
            sock.close()
            raise
        if "error" in reply:
            sock.close()
            raise RankError(f"rank {dist.rank}: {shown(reply['error'])}")
        return cls(dist, {0: sock}, reply.get("payload"), on_lost)

    @staticmethod
    def _dial(dist: Distributed, deadline: float, where: str, timeout: float) -> socket.socket:
        """A connection to rank 0, retried until `deadline` (rank 0 may start later)."""
        last = None
        while time.monotonic() < deadline:
            try:
                return socket.create_connection((dist.master_addr, dist.master_port),
                                                timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError as e:
                last = e
                time.sleep(0.2)
        raise RankError(f"rank {dist.rank}: rank 0 did not answer at {where} within {timeout:g} s ({last})")

    @staticmethod
    def _gather(dist: Distributed, payload, deadline: float, where: str, timeout: float) -> dict:
        """Rank 0: accept every other rank, check their world sizes and ranks, answer each."""
        server = socket.create_server(("", dist.master_port), reuse_port=False)
        socks: dict[int, socket.socket] = {}
        try:
            problem = None
            pending = []
            while len(socks) + len(pending) < dist.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:       # the ranks that came are told too, not left waiting for their own timeout
                    missing = sorted(set(range(1, dist.world_size)) - set(socks))
                    problem = f"ranks {missing} did not arrive at {where} within {timeout:g} s"
                    break
                server.settimeout(left)
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                try:
                    hello = _receive(sock, deadline, "rank 0: rendezvous")
                except RankError:
                    sock.close()
                    continue
                rank, world = hello.get("rank"), hello.get("world_size")     # from whatever connected: untrusted
                if world != dist.world_size:
                    problem = f"rank {quoted(rank)} has WORLD_SIZE={quoted(world)} but rank 0 has WORLD_SIZE=" \
                              f"{dist.world_size}"
                    pending.append(sock)
                elif type(rank) is not int or not 0 < rank < dist.world_size or rank in socks:
                    problem = f"two ranks claim RANK={rank}" if type(rank) is int and rank in socks else \
                        f"a rank claims RANK={quoted(rank)}"
                    pending.append(sock)
                else:
                    socks[rank] = sock
                if problem:
                    break
            for sock in list(socks.values()) + pending:
                _send(sock, {"error": problem} if problem else {"payload": payload})
            if problem:
                for sock in list(socks.values()) + pending:
                    sock.close()
                raise RankError(f"rank 0: {problem}")
            return socks
        finally:
            server.close()

    def _watch(self) -> None:
        """Wait on the peers' connections; a drop without goodbye is a lost rank."""
        socks = dict(self.socks)
        while socks:
            try:
                ready, _, _ = select.select(list(socks.values()), [], [], 0.5)
            except (OSError, ValueError):       # closed by close(): this rank is leaving
                return
            for sock in ready:
                peer = next(r for r, s in socks.items() if s is sock)
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if data:
                    for line in data.splitlines():
                        with self.lock:
                            try:
                                message = json.loads(line)
                            except ValueError:
                                message = {}
                            message = message if isinstance(message, dict) else {}
                            if message.get("bye"):
                                self.said_bye.add(peer)
                            elif message.get("failed"):
                                self._lost(f"rank {self.dist.rank}: rank {peer} failed: {shown(message['failed'])}")
                    continue
                del socks[peer]
                with self.lock:
                    if peer not in self.said_bye and not self.closing:
                        self._lost(f"rank {self.dist.rank}: rank {peer} exited without closing the group (it died "
                                   "or was killed); stopping")

    def _lost(self, message: str) -> None:
        self.closing = True
        self.on_lost(message)

    def close(self, failed: str | None = None, timeout: float = 30.0) -> None:
        """Say goodbye (or that this rank failed, naming why) and close; rank 0 first waits for the others'."""
        with self.lock:
            if self.closing:
                return
            self.closing = failed is not None
        for sock in self.socks.values():
            try:
                _send(sock, {"failed": failed} if failed else {"bye": True})
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        if self.dist.rank == 0 and not failed:
            while len(self.said_bye) < len(self.socks) and time.monotonic() < deadline and self.thread.is_alive():
                time.sleep(0.01)
        self.closing = True
        for sock in self.socks.values():
            sock.close()


def _exit_lost(message: str) -> None:
    print(f"tilekit: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)
