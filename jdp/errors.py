"""jdp's error for input that cannot run, here alone so that any module can raise it without importing the config."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config or other input that cannot run (a library call's batch, loss or used state included); raised
    before any data is loaded or anything is compiled."""
