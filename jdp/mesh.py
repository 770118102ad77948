"""The `data` mesh and global batches: every device of every process on one axis, each process's rows of a
global batch, and the placements the strategies use (replicated, split along `data`, the master device)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.guards import check_rows

__all__ = [
    "AXIS",
    "Batch",
    "batch_sharding",
    "replicate",
    "make_mesh",
    "master_device",
    "process_rows",
    "replicated",
    "shard_batch",
    "split_spec",
]

AXIS = "data"
Batch = dict[str, Any]


def make_mesh(devices: list | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh with axis `data` over every device of every process (or the devices given)."""
    devices = jax.devices() if devices is None else list(devices)
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def replicate(tree, mesh: jax.sharding.Mesh):
    """`tree` placed whole on every device of the mesh, of every process. Random keys (dropout's) go as their data:
    JAX places a typed key array only onto devices this process addresses."""
    sharding = replicated(mesh)

    def put(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.device_put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def process_rows(global_batch: int, mesh: jax.sharding.Mesh) -> slice:
    """The rows of every global batch that this process materialises (its devices' rows, in mesh order)."""
    devices = list(mesh.devices.flat)
    per_device = global_batch // len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError("this process's devices are not contiguous in the mesh; build it with make_mesh()")
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def shard_batch(local: Batch, mesh: jax.sharding.Mesh, global_batch: int | None = None) -> Batch:
    """This process's rows (numpy, leading axis = rows) -> global jax.Arrays sharded along `data`."""
    sharding = batch_sharding(mesh)

    def put(path, x):
        x = np.asarray(x)
        rows = None if x.ndim == 0 else global_batch if global_batch is not None else x.shape[0] * jax.process_count()
        check_rows(path, rows, mesh.devices.size, 1, "shard_batch")
        return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))

    return jax.tree_util.tree_map_with_path(put, local)


def split_spec(ndim: int) -> P:
    """The last axis split over `data` (OptLayout's flat leaves)."""
    return P(*([None] * (ndim - 1)), AXIS)


def master_device(mesh: jax.sharding.Mesh):
    """dp's master: the mesh's first device."""
    return mesh.devices.flat[0]
