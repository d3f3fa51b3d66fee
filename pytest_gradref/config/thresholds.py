"""The growth threshold of a report comparison: how many times an item's error may grow before
it is a regression, by default and at the least.

Shared by ``--gradref-baseline-threshold`` (settings.py reads and checks it) and the diff judge
(``report/diff.py``, also ``pytest-gradref diff``): here, in config, since config imports no
other wing. It imports nothing, so ``pytest-gradref diff`` still starts without pytest or torch.
"""

from __future__ import annotations

DEFAULT_THRESHOLD = 2.0
# A threshold below 1 would call unchanged errors regressions.
MIN_THRESHOLD = 1.0
