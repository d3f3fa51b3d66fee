"""The repository's own checks: its layout, docs and their checks, CI's stage budgets, the
declared version bounds, the README's main job, the worker count of ``-n auto``.

The main job's check collects the kernel suite in processes forked from a process that
imported torch once: the plugin tests' helper (tests/plugin/_forked_runs.py), found here
through the path below.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
