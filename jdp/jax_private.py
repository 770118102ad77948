"""Every use jdp makes of JAX's private API (`jax._src`), in one place: each is what no public API offers, and each
was checked on JAX 0.10.2, 0.11 and 0.12.0.1 (CI runs the oldest and the newest; the multi-process tests, and
tests/test_hosts.py across hosts, go through all of them). A JAX that moves one fails here, by name."""

from __future__ import annotations

from typing import Any

__all__ = ["backends_are_initialized", "distributed_client", "missing_key_value_api", "use_gloo_cpu_backend"]


def backends_are_initialized() -> bool:
    """Whether JAX has started a backend (then XLA flags set now are not read): xla_bridge has no public question."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def use_gloo_cpu_backend(options: dict) -> None:
    """Register JAX's CPU backend again, its gloo collectives made with `options` (hostname or interface): JAX makes
    gloo from its own defaults, with no public way to say where. Raises ImportError, AttributeError or TypeError
    where this JAX differs."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client, **options)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def distributed_client() -> Any:
    """The joined job's key-value store client (jax.distributed's), or None: JAX exposes no public handle to it."""
    from jax._src import distributed

    return getattr(getattr(distributed, "global_state", None), "client", None)


def missing_key_value_api(methods: tuple[str, ...]) -> list[str]:
    """What jdp needs of the key-value store client that this JAX lacks (empty when all is there)."""
    try:
        from jax._src import distributed
        from jax._src.lib import _jax
    except ImportError as e:
        return [f"cannot import it ({e})"]
    missing = (
        [] if hasattr(getattr(distributed, "global_state", None), "client") else ["distributed.global_state.client"]
    )
    client_type = getattr(_jax, "DistributedRuntimeClient", None)
    if client_type is None:
        return [*missing, "_jax.DistributedRuntimeClient"]
    return missing + [f"DistributedRuntimeClient.{m}" for m in methods if not hasattr(client_type, m)]
