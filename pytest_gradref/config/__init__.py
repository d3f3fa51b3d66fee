"""The configuration: the settings and where each value came from, the session's resolved device
and strategy, its state, the markers, the tolerance tables and the check policy.

The lowest wing: it imports no other wing at load. Every module loads without torch, and they
import one another at the top (the plugin loads them all at start-up).
"""
