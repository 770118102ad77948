"""The job: which processes make it and how they start, join and agree, before and while a run steps.

The modules, in the order a job comes up: world.py (which job this process belongs to: explicit options or a
launcher's variables, one detector each), process.py (this process as a worker: it never outlives its launcher) and
xla.py (the XLA options set before JAX starts), join.py (joining through `jax.distributed`), rendezvous.py and
launch.py (`jdp launch`, the torchrun of jdp, elastic with --nnodes MIN:MAX), coordination.py (what the processes
agree on while running: the stop step, the step watchdog). This package imports nothing itself: the strategy registry
asks xla.py without JAX.
"""
