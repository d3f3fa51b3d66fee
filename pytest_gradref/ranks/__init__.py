"""Multi-rank tests: the pytest side (the marker, the fixture, the hooks), the controller's
rank processes, the worker that runs in each rank, sharded gradients, and the launcher mode
(under torchrun, each launcher process one rank).

The highest wing: imports config, devices and, in sharding, reference at load. The worker is
a leaf of the pytest side: it imports nothing from ``pytest_side`` or ``processes``.
"""
