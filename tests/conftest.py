"""Tests run on 4 simulated CPU devices: forced here, before anything imports jax."""

import os

N_DEVICES = 4
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
