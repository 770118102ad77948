"""The `data` mesh and global batches: every device of every process on one axis, each process's rows of a
global batch, and the placements the strategies use (replicated, split along `data`, the master device)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.parallel.guards import check_rows

__all__ = [
    "AXIS",
    "GROUP",
    "REPLICA",
    "SHARD",
    "Batch",
    "batch_axes",
    "batch_sharding",
    "replicate",
    "make_mesh",
    "master_device",
    "process_rows",
    "replicated",
    "shard_axis",
    "shard_batch",
    "shard_count",
    "split_spec",
]

AXIS = "data"
REPLICA, SHARD = "replica", "shard"  # hsdp's mesh: groups of shard_size devices, the state split inside each
GROUP = "group"  # DiLoCo's mesh (`group`, `data`): groups that train apart, each group's state on its own devices
Batch = dict[str, Any]


def make_mesh(devices: list | None = None, shard_size: int = 0) -> jax.sharding.Mesh:
    """A 1-D mesh with axis `data` over every device of every process (or the devices given). With shard_size=K
    (hsdp), a 2-D mesh (`replica`, `shard`) of the same devices in the same order: groups of K consecutive devices
    (a node's), so each device takes the same rows of every global batch as on the 1-D mesh."""
    devices = jax.devices() if devices is None else list(devices)
    if not shard_size:
        return jax.sharding.Mesh(np.asarray(devices), (AXIS,))
    if shard_size < 1 or len(devices) % shard_size:
        raise ValueError(
            f"shard_size={shard_size} must divide the {len(devices)} devices into equal groups (a node's devices)"
        )
    return jax.sharding.Mesh(np.asarray(devices).reshape(len(devices) // shard_size, shard_size), (REPLICA, SHARD))


def batch_axes(mesh: jax.sharding.Mesh, within_group: bool = False):
    """The mesh axes a global batch's rows are split over (every one): `data`, or (`replica`, `shard`), or DiLoCo's
    (`group`, `data`); within_group: a DiLoCo group's rows, over `data` only (the step run in every group at once)."""
    names = tuple(a for a in mesh.axis_names if not (within_group and a == GROUP))
    return names[0] if len(names) == 1 else names


def shard_axis(mesh: jax.sharding.Mesh) -> str:
    """The axis fsdp and hsdp split the state over: all of `data`, or `shard` inside each group."""
    return SHARD if SHARD in mesh.axis_names else AXIS


def shard_count(mesh: jax.sharding.Mesh) -> int:
    """The devices the state is split over (fsdp: all; hsdp: a group's)."""
    return int(mesh.shape[shard_axis(mesh)])


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def per_group(sharding: NamedSharding) -> NamedSharding:
    """Where the groups' copies of an array placed by `sharding` live on DiLoCo's mesh: a leading axis of the groups
    over `group`, the rest placed as before (zero1's optimizer slices over `data`)."""
    return NamedSharding(sharding.mesh, P(GROUP, *sharding.spec))


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
    return NamedSharding(mesh, P(batch_axes(mesh)))


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
