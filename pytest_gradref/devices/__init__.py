"""The devices: the backend policies and their registry, the device of each xdist worker, and
the simulated npu with the Ascend numerics it can model.

Imports config at load. The backends and the xdist hooks load without torch; the simulated
npu loads torch and is imported where a run asks for it.
"""
