"""Real processes under jax.distributed (gloo on CPU): they must train and load data exactly like one process."""

import json
import textwrap

import numpy as np
import pytest

from jdp.data import Batches

pytestmark = pytest.mark.slow

DATA_WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    from jax.experimental import multihost_utils
    from jdp import parallel
    from jdp.data import Batches

    from jdp.job.join import initialize
    from jdp.job.world import resolve_world

    initialize(resolve_world())
    mesh = parallel.make_mesh()
    B, steps = 8, 12
    rows = parallel.process_rows(B, mesh)
    batches = Batches(np.arange(10 * 37 + 1, dtype=np.uint16), 10, B, seed=3)
    local_windows, global_windows = [], []
    for step in range(steps):
        local = batches.batch(step, rows)
        g = parallel.shard_batch(local, mesh, B)
        # Read the assembled global array back: it must be the single-process batch.
        full = multihost_utils.process_allgather(g["inputs"], tiled=True)
        global_windows.append((np.asarray(full)[:, 0] // 10).tolist())
        local_windows.append((local["inputs"][:, 0] // 10).tolist())
    out = {"rows": [rows.start, rows.stop], "local": local_windows, "global": global_windows}
    with open(sys.argv[1] + f".{jax.process_index()}", "w") as f:
        json.dump(out, f)
    """
)


def test_two_processes_assemble_the_single_process_global_batches(tmp_path, spawn):
    script = tmp_path / "worker.py"
    script.write_text(DATA_WORKER)
    results = spawn([str(script), str(tmp_path / "out")], n_processes=2, devices_each=2, timeout=240)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    outs = [json.loads((tmp_path / f"out.{pid}").read_text()) for pid in range(2)]
    assert [o["rows"] for o in outs] == [[0, 4], [4, 8]]  # exclusive, contiguous rows per process
    reference = Batches(np.arange(10 * 37 + 1, dtype=np.uint16), 10, 8, seed=3)
    union = []
    for step in range(12):
        expected = (reference.batch(step)["inputs"][:, 0] // 10).tolist()
        assert outs[0]["global"][step] == outs[1]["global"][step] == expected
        assert outs[0]["local"][step] + outs[1]["local"][step] == expected
        union += outs[0]["local"][step] + outs[1]["local"][step]
    # 12 steps x 8 = 96 windows = 2 whole epochs of 37 and part of a third: each epoch exactly once.
    assert sorted(union[:37]) == sorted(union[37:74]) == list(range(37))


KV_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    from jax.experimental import multihost_utils
    from jdp.job.coordination import StopAgreement, Watchdog, key_value_store
    from jdp.job.join import initialize
    from jdp.job.world import resolve_world

    initialize(resolve_world())
    kv = key_value_store()
    me = jax.process_index()
    kv.set(f"test/{me}", f"value {me}")
    if me == 1:  # what a stranger who reached the coordinator could write
        kv.set(StopAgreement.KEY, "../../etc")
        kv.set(Watchdog.PREFIX + "7", "-3")
        kv.set(Watchdog.PREFIX + "x", "1")
    multihost_utils.sync_global_devices("written")
    stop = StopAgreement()
    watchdog = Watchdog(3600)
    watchdog.progress(5 + me)
    watchdog.publish()  # what its thread does within a second of a step (not on the step's path)
    multihost_utils.sync_global_devices("progress")
    out = {
        "values": kv.dir_get("test/"),
        "missing": kv.try_get("test/none"),
        "stops": [stop.should_stop(done) for done in (0, 10**6)],
        "behind": watchdog._behind(),
    }
    multihost_utils.sync_global_devices("read")
    if me == 1:  # a step number, but one every process has passed: out of range
        kv.set(StopAgreement.KEY, "2", overwrite=True)
    multihost_utils.sync_global_devices("past")
    out["past"] = [stop.should_stop(5), stop.should_stop(6)]
    multihost_utils.sync_global_devices("checked")
    if me == 1:  # what jdp itself proposes: a step ahead of every process
        kv.set(StopAgreement.KEY, "9", overwrite=True)
    multihost_utils.sync_global_devices("ahead")
    out["ahead"] = [stop.should_stop(8), stop.should_stop(9)]
    stop.close()
    watchdog.close()
    multihost_utils.sync_global_devices("done")
    with open(sys.argv[1] + f".{me}", "w") as f:
        json.dump(out, f)
    """
)


def test_key_value_store_round_trips_and_ignores_values_jdp_did_not_write(tmp_path, spawn):
    script = tmp_path / "worker.py"
    script.write_text(KV_WORKER)
    results = spawn([str(script), str(tmp_path / "out")], n_processes=2, devices_each=1, timeout=240)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    for pid in range(2):
        out = json.loads((tmp_path / f"out.{pid}").read_text())
        assert out["values"] == {"test/0": "value 0", "test/1": "value 1"}
        assert out["missing"] is None
        assert out["stops"] == [False, False]  # a malformed stop step is no stop step
        assert out["past"] == [False, False]  # nor is one already passed
        assert out["ahead"] == [False, True]
        assert out["behind"] == "; processes behind the others: [0] (last steps: {0: 5, 1: 6})"
        assert "ignoring jdp/stop_after_step='../../etc'" in results[pid][2]
        assert results[pid][2].count("ignoring jdp/stop_after_step=2 ") == 1
