"""Elastic membership for `jdp launch --nnodes MIN:MAX` (torchrun's elastic rendezvous), kept in files on storage
every node sees (`--rdzv-dir`, e.g. beside the run directory).

The job runs in rounds. Each node's launcher joins a round by writing its member file (its address, workers, the
node rank it asked for); the round closes when MAX nodes have joined, or when at least MIN have and no more came
for `--rdzv-timeout` seconds. The first launcher to close it writes `closed.json` (created exclusively, so one
list wins), which fixes the world: node ranks in the order asked for, node rank 0's address the coordinator. When
a round's workers end, each launcher marks the round ended (ok or failed) and, with restarts left, joins the next
round; the survivors of a lost host thus re-form without it, and a launcher that starts late (a host back) waits
until the running round ends and joins the next.

Membership lives in the shared directory, not on any one node: losing any host, the coordinator's included,
leaves the others able to re-form (torchrun's c10d rendezvous keeps it in a store on one node, lost with it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Membership", "Rendezvous", "RendezvousError"]

POLL_S = 0.2


class RendezvousError(RuntimeError):
    """Not enough nodes joined, or the rendezvous directory cannot be used."""


@dataclass(frozen=True)
class Membership:
    round: int
    node_rank: int
    nnodes: int
    coordinator_host: str
    members: tuple[str, ...]  # each node's address, by node rank


class Rendezvous:
    def __init__(self, path: str | Path, min_nodes: int, max_nodes: int, nproc: int, address: str, rank_hint: int,
                 timeout_s: float, join_timeout_s: float = 600.0):  # fmt: skip
        self.dir = Path(path)
        self.min, self.max, self.nproc = min_nodes, max_nodes, nproc
        self.address, self.hint = address, rank_hint
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        self.id = f"{rank_hint:05d}-{socket.gethostname()}-{address}-{os.getpid()}"
        probe = self.dir / f".probe-{self.id}"
        try:  # made and written here, or the nodes would find out only when they meet
            self.dir.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise RendezvousError(
                f"--rdzv-dir {self.dir}: cannot write there ({e.strerror or e}); give a directory every node can "
                f"write, on storage they share"
            ) from None

    # -- the rounds on disk ----------------------------------------------------------------------------------------

    def _round(self, r: int) -> Path:
        return self.dir / str(r)

    def rounds(self) -> list[int]:
        return sorted(int(p.name) for p in self.dir.iterdir() if p.name.isdigit())

    def closed(self, r: int) -> list[dict] | None:
        try:
            return json.loads((self._round(r) / "closed.json").read_text())["members"]
        except (OSError, ValueError, KeyError):
            return None

    def ended(self, r: int) -> str | None:
        try:
            return (self._round(r) / "ended").read_text().strip() or "failed"
        except OSError:
            return None

    def end(self, r: int, ok: bool) -> None:
        """Mark round r over (every launcher does, as its workers stop): late joiners may close the next one."""
        path = self._round(r) / "ended"
        if ok or not path.exists():
            _write(path, "ok" if ok else "failed")

    def _members(self, r: int) -> list[dict]:
        out = []
        for p in sorted((self._round(r) / "members").glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue  # being written
        return out

    def first_round(self) -> int:
        """Where a launcher starting now joins: the newest round if it is still open, else the one after it."""
        rounds = self.rounds()
        if not rounds:
            return 0
        newest = rounds[-1]
        return newest if self.closed(newest) is None else newest + 1

    # -- joining ---------------------------------------------------------------------------------------------------

    def join(self, r: int, say=lambda msg: None) -> Membership | None:
        """Join round r (or, if it closed without this node, the next), block until it closes with this node in
        it, and return the world. None: the job finished (the round before ended ok) while this node waited."""
        deadline = time.monotonic() + self.join_timeout_s
        r = max(r, 0)
        self.enter(r)
        enough_since = None
        waiting_said = False
        while True:
            members = self.closed(r)
            if members is not None:
                ids = [m["id"] for m in members]
                if self.id in ids:
                    return self._membership(r, members)
                r += 1  # it closed without this node (joined late): the next round
                self.enter(r)
                enough_since = None
                continue
            before = r - 1
            if before >= 0 and self.closed(before) is not None:
                state = self.ended(before)
                if state == "ok":
                    return None
                if state is None:  # the job of the round before still runs: this node joins at its end
                    if not waiting_said:
                        say(f"rendezvous: round {before} is running without this node; joining round {r} when it ends")
                        waiting_said = True
                    deadline = time.monotonic() + self.join_timeout_s
                    time.sleep(POLL_S)
                    continue
            joined = self._members(r)
            if len(joined) >= self.min and enough_since is None:
                enough_since = time.monotonic()
            full = len(joined) >= self.max
            waited = enough_since is not None and time.monotonic() - enough_since >= self.timeout_s
            if full or waited:
                self._close(r, joined)
                continue
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rendezvous round {r} in {self.dir}: {len(joined)} of at least {self.min} nodes joined within "
                    f"{self.join_timeout_s:g} s ({', '.join(m['address'] for m in joined) or 'none'})"
                )
            time.sleep(POLL_S)

    def enter(self, r: int) -> None:
        """Write this node's member file into round r (join does; a launcher whose workers just stopped does it
        before marking their round ended)."""
        member = {"id": self.id, "address": self.address, "nproc": self.nproc, "hint": self.hint}
        _write(self._round(r) / "members" / f"{self.id}.json", json.dumps(member))

    def _close(self, r: int, joined: list[dict]) -> None:
        """Fix round r's members (at most max, in the order of the node ranks asked for), unless another did."""
        lock = self._round(r) / "closed.lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # another launcher closes it: read its list next
        os.close(fd)
        members = sorted(joined, key=lambda m: (m["hint"], m["id"]))[: self.max]
        _write(self._round(r) / "closed.json", json.dumps({"members": members}))

    def _membership(self, r: int, members: list[dict]) -> Membership:
        nprocs = {m["nproc"] for m in members}
        if len(nprocs) > 1:
            raise RendezvousError(f"rendezvous round {r}: nodes with different --nproc-per-node {sorted(nprocs)}")
        ids = [m["id"] for m in members]
        return Membership(r, ids.index(self.id), len(members), members[0]["address"],
                          tuple(m["address"] for m in members))  # fmt: skip


def _write(path: Path, text: str) -> None:
    """Write a file whole or not at all (rename), its directory made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
