"""The preference consumer's conftest, written as a kernel library writes its own: it imports
the suite's test utilities, which find the device as they are imported, and seeds every test.

Seeding: gradref seeds each test before its fixtures run, and ``set_random_seed`` runs after
and wins, so ``--gradref-seed`` changes nothing here; the report marks these tests
``reseeded`` (torch seed 42), and reports compare them by their inputs' fingerprints. This
conftest leaves gradref's seeding on all the same: ``gradref_seed`` is one setting for the
whole session, and the repository's other suites (the plugin's tests, the DPO head of
tests/adopters, whose weights come from ``nn.Linear``'s initialisation) draw from torch's
generator without seeding it. A library whose every test seeds itself, as Liger-Kernel's
do, would put ``gradref_seed = "off"`` in its own ini file instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from preference_utils import set_seed

# prefkit, the library these tests exercise, sits one directory up (where a library's tests
# would find it installed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(autouse=True)
def set_random_seed() -> None:
    set_seed(42)
