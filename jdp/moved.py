"""The module paths the redesign moved (into models/, data/, parallel/ and job/), still importable for one release.

`import jdp` puts `Finder` last on `sys.meta_path`, so it answers only for a name no file has. An old path imports
as a stand-in module whose names are the new home's own objects (or, where the old module was split, each name's
own home), with a DeprecationWarning naming the new path. Nothing here imports JAX before an old path is used.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import types
import warnings

MOVED = {  # old path -> new home
    "jdp.model": "jdp.models.gpt",
    "jdp.llama": "jdp.models.llama",
    "jdp.corpus": "jdp.data.corpus",
    "jdp.tokens": "jdp.data.tokens",
    "jdp.formats": "jdp.data.formats",
    "jdp.dataset": "jdp.data.dataset",
    "jdp.stream": "jdp.data.stream",
    "jdp.sft": "jdp.data.sft",
    "jdp.mixture": "jdp.data.mixture",
    "jdp.buckets": "jdp.parallel.buckets",
    "jdp.costs": "jdp.parallel.costs",
    "jdp.guards": "jdp.parallel.guards",
    "jdp.hooks": "jdp.parallel.comm_hooks",
    "jdp.mesh": "jdp.parallel.mesh",
    "jdp.step": "jdp.parallel.step",
    "jdp.strategies": "jdp.parallel.strategies",
    "jdp.strategies.ddp": "jdp.parallel.strategies.ddp",
    "jdp.strategies.dp": "jdp.parallel.strategies.dp",
    "jdp.strategies.fsdp": "jdp.parallel.strategies.fsdp",
    "jdp.strategies.hsdp": "jdp.parallel.strategies.hsdp",
    "jdp.strategies.zero1": "jdp.parallel.strategies.zero1",
    "jdp.world": "jdp.job.world",
    "jdp.process": "jdp.job.process",
    "jdp.xla": "jdp.job.xla",
    "jdp.join": "jdp.job.join",
    "jdp.rendezvous": "jdp.job.rendezvous",
    "jdp.launch": "jdp.job.launch",
    "jdp.coordination": "jdp.job.coordination",
    "jdp.train": "jdp.lm",
}
JOIN, PROCESS, XLA = "jdp.job.join", "jdp.job.process", "jdp.job.xla"
SPLIT = {  # an old module's names that live elsewhere now: name -> home
    "jdp.model": {
        **dict.fromkeys(("lm_loss", "count_params"), "jdp.models.common"),
        "make_model": "jdp.models",
        **dict.fromkeys(("causal_attention", "attention_scores", "query_blocks"), "jdp.attention"),
    },
    "jdp.sft": dict.fromkeys(("answer_spans", "encode_with_offsets"), "jdp.data.chat"),
    "jdp.world": {  # what the released world.py held besides the job's description
        **dict.fromkeys(("initialize", "JoinError", "check_port_free", "bind_address", "BIND_ENV"), JOIN),
        **dict.fromkeys(("watch_launcher", "flush_every_line", "tolerate_broken_pipes"), PROCESS),
        **dict.fromkeys(("set_xla_flags", "collective_flags", "keep_scratch_memory", "use_compilation_cache"), XLA),
    },
    "jdp.train": {"RunError": "jdp.trainer"},
}


def new_home(old: str) -> str:
    """Where `old`'s names are now, in words: "jdp.models.gpt (lm_loss, count_params: jdp.models.common; ...)"."""
    homes: dict[str, list[str]] = {}
    for name, home in SPLIT.get(old, {}).items():
        homes.setdefault(home, []).append(name)
    split = "; ".join(f"{', '.join(names)}: {home}" for home, names in homes.items())
    return MOVED[old] + (f" ({split})" if split else "")


class Moved(types.ModuleType):
    """An old path: each name looked up in its home on use, so it is the very object the new path gives."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name != "__all__":  # the import system's own (__path__, __file__): not forwarded
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        home = importlib.import_module(SPLIT.get(self.__name__, {}).get(name, MOVED[self.__name__]))
        if name == "__all__" and not hasattr(home, "__all__"):  # `from jdp.model import *`
            return [n for n in vars(home) if not n.startswith("_")]
        return getattr(home, name)

    def __dir__(self) -> list[str]:
        return sorted({*dir(importlib.import_module(MOVED[self.__name__])), *SPLIT.get(self.__name__, {})})

    def __call__(self, *args, **kwargs):
        """`import jdp.train` sets the attribute `jdp.train` to this module, as the old module did: it still trains."""
        if self.__name__ != "jdp.train":
            raise TypeError(f"module {self.__name__!r} is not callable")
        return self.train(*args, **kwargs)


class Finder:
    """A meta-path finder and loader for the old paths in MOVED."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec) -> Moved:
        return Moved(spec.name)

    def exec_module(self, module: Moved) -> None:
        home = importlib.import_module(MOVED[module.__name__])  # a broken home fails here, at the import
        if hasattr(home, "__path__"):  # a package: `import jdp.strategies.ddp` goes on from here
            module.__path__ = []
        message = f"{module.__name__} moved to {new_home(module.__name__)}; import it from there (docs/changes.md)"
        warnings.warn(message, DeprecationWarning, stacklevel=2)


def install(meta_path: list) -> None:
    """Put one Finder last on `meta_path` (once, however often jdp is imported or reloaded)."""
    if not any(type(f).__name__ == "Finder" and type(f).__module__ == __name__ for f in meta_path):
        meta_path.append(Finder())
