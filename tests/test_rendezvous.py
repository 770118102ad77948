"""The elastic rendezvous of `jdp launch --nnodes MIN:MAX` (jdp/job/rendezvous.py) on its own: launchers as threads
sharing one directory. The same code between real hosts: tests/test_hosts.py's elastic test."""

import threading
import time

import pytest

from jdp.job.launch import LaunchError, nodes_range
from jdp.job.rendezvous import Rendezvous, RendezvousError


def node(tmp_path, hint, address, lo=1, hi=2, nproc=2, timeout_s=0.5, join_timeout_s=20):
    return Rendezvous(tmp_path / "rdzv", lo, hi, nproc, address, hint, timeout_s, join_timeout_s)


def join_all(nodes, r=0):
    out = [None] * len(nodes)

    def go(i):
        out[i] = nodes[i].join(r)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_full_round_closes_at_once_in_the_order_of_the_node_ranks_asked_for(tmp_path):
    a, b = node(tmp_path, 1, "10.0.0.2", timeout_s=60), node(tmp_path, 0, "10.0.0.1", timeout_s=60)
    ma, mb = join_all([a, b])
    assert (ma.nnodes, ma.node_rank, mb.node_rank) == (2, 1, 0)  # MAX reached: no waiting for the timeout
    assert ma.coordinator_host == mb.coordinator_host == "10.0.0.1" and ma.members == ("10.0.0.1", "10.0.0.2")


def test_survivors_re_form_without_a_lost_node_and_a_late_node_waits_for_the_next_round(tmp_path):
    a, b = node(tmp_path, 0, "10.0.0.1"), node(tmp_path, 1, "10.0.0.2")
    join_all([a, b])
    a.end(0, ok=False)  # node b is lost: only a goes on
    alone = a.join(1)
    assert (alone.round, alone.nnodes, alone.coordinator_host) == (1, 1, "10.0.0.1")
    back = node(tmp_path, 1, "10.0.0.2")
    assert back.first_round() == 2  # round 1 is running without it
    got = []
    waiter = threading.Thread(target=lambda: got.append(back.join(back.first_round())))
    waiter.start()
    waiter.join(1.5)
    assert waiter.is_alive()  # it does not start a job of its own beside the running one
    # The next restart: the launcher enters round 2 before it marks round 1 ended, so the waiting node cannot close
    # round 2 alone, however long the launcher then takes to stop its workers (longer than the 0.5 s timeout here).
    a.enter(2)
    a.end(1, ok=False)
    time.sleep(1.5)
    again = a.join(2)
    waiter.join(20)
    assert (again.nnodes, got[0].nnodes, got[0].node_rank) == (2, 2, 1)


def test_a_lost_coordinator_leaves_the_others_to_re_form_with_a_new_one(tmp_path):
    a, b = node(tmp_path, 0, "10.0.0.1"), node(tmp_path, 1, "10.0.0.2")
    join_all([a, b])
    b.end(0, ok=False)  # node 0, the coordinator, is lost: membership lives in the shared directory
    m = b.join(1)
    assert (m.nnodes, m.node_rank, m.coordinator_host) == (1, 0, "10.0.0.2")


def test_a_node_waiting_when_the_job_finishes_is_told_so(tmp_path):
    a = node(tmp_path, 0, "10.0.0.1")
    assert a.join(0).nnodes == 1
    late = node(tmp_path, 1, "10.0.0.2")
    a.end(0, ok=True)
    assert late.join(late.first_round()) is None


def test_too_few_nodes_and_different_worker_counts_are_clear_errors(tmp_path):
    with pytest.raises(RendezvousError, match=r"1 of at least 2 nodes joined within 0.5 s \(10.0.0.1\)"):
        node(tmp_path, 0, "10.0.0.1", lo=2, hi=3, join_timeout_s=0.5).join(0)
    a, b = node(tmp_path / "x", 0, "10.0.0.1", nproc=2), node(tmp_path / "x", 1, "10.0.0.2", nproc=4)
    errors = []

    def go(n):
        try:
            n.join(0)
        except RendezvousError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=go, args=(n,)) for n in (a, b)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert len(errors) == 2 and "different --nproc-per-node [2, 4]" in errors[0]


@pytest.mark.parametrize("text, expected", [("2", (2, 2)), ("1:4", (1, 4)), (3, (3, 3))])
def test_nnodes_takes_a_count_or_an_elastic_range(text, expected):
    assert nodes_range(text) == expected


@pytest.mark.parametrize("text", ["0", "3:2", "a:b", "1:"])
def test_a_bad_nnodes_is_refused(text):
    with pytest.raises(LaunchError, match="--nnodes"):
        nodes_range(text)


def test_an_rdzv_dir_that_cannot_be_written_is_one_line_and_exit_2_before_any_worker(tmp_path):
    """Issue 42, item 9: --rdzv-dir under a file (or on a read-only mount) raised RendezvousError as a traceback.
    Now the launcher says why in one line, exits 2, and starts no worker."""
    import subprocess
    import sys

    (tmp_path / "afile").write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "launch", "--nnodes", "1:2", "--rdzv-dir", str(tmp_path / "afile" / "rdzv"),
         "--coordinator", "127.0.0.1:29555", "--nproc-per-node", "1", "--", "train", "configs/tiny.yaml"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        f"jdp launch: error: --rdzv-dir {tmp_path / 'afile' / 'rdzv'}: cannot write there (Not a directory); give a "
        f"directory every node can write, on storage they share"
    ), out.stderr
    assert "started ranks" not in out.stderr + out.stdout
