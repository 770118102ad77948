"""A network link in user space, for kernels built without `sch_netem`: two TAP devices and this process between
them, forwarding every Ethernet frame from one to the other after a delay (with jitter) or dropping it (loss).
tests/hosts.py puts one end in a host's namespace (its eth0) and the other on the bridge, and tells this process how
to shape the link through its stdin, one JSON object per line: {"delay_ms": 20, "jitter_ms": 5, "loss_pct": 1}.

    python wire.py HOST_END BRIDGE_END      # run in the namespace both ends are made in; prints "ready" once made

Delay: each frame waits delay_ms plus a uniform draw in [-jitter_ms, +jitter_ms] (netem's default distribution),
but never leaves before a frame sent before it on the same direction (netem reorders; links seldom do). Loss: each
frame is dropped with probability loss_pct / 100, independently (netem's default). A frame written to an end whose
link is down (a partition) is dropped, as on a cable that is cut. Counts go to stderr when stdin closes.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main(host_end: str, bridge_end: str) -> None:
    ends = [tap(host_end), tap(bridge_end)]
    other = {ends[0]: ends[1], ends[1]: ends[0]}
    shape = {"delay_ms": 0.0, "jitter_ms": 0.0, "loss_pct": 0.0}
    rng = random.Random(0)
    queue: list[tuple[float, int, int, bytes]] = []  # (due, sequence, fd to write, frame)
    last_due = dict.fromkeys(ends, 0.0)
    counts = {"forwarded": 0, "lost": 0, "dropped_link_down": 0}
    seq = 0
    stdin = sys.stdin.fileno()
    print("ready", flush=True)
    watch = [*ends, stdin]
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, frame = heapq.heappop(queue)
            try:
                os.write(fd, frame)
                counts["forwarded"] += 1
            except OSError:  # the end's link is down (EIO) or its queue is full: the frame is gone
                counts["dropped_link_down"] += 1
        timeout = max(0.0, queue[0][0] - now) if queue else None
        readable, _, _ = select.select(watch, [], [], timeout)
        for fd in readable:
            if fd == stdin:
                line = sys.stdin.readline()
                if not line:
                    print(json.dumps(counts), file=sys.stderr, flush=True)
                    return
                shape.update({k: float(v) for k, v in json.loads(line).items()})
                continue
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # the device went away with its namespace
                    return
                if shape["loss_pct"] and rng.random() * 100 < shape["loss_pct"]:
                    counts["lost"] += 1
                    continue
                out = other[fd]
                delay = shape["delay_ms"] + (rng.uniform(-1, 1) * shape["jitter_ms"] if shape["jitter_ms"] else 0)
                due = max(time.monotonic() + max(0.0, delay) / 1000, last_due[out])
                last_due[out] = due
                seq += 1
                heapq.heappush(queue, (due, seq, out, frame))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
