"""The one judge of items: ``check_items`` compares a set of items (an ``assert_close``'s, a
crosscheck's) with one host read per device.

Each kind of item (tolerance_item.py, budget_item.py) computes its own numbers, judges them and
writes its own failure message; the judge only gathers the numbers and hands them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Union

import torch

from pytest_gradref.verdict.budget_item import BudgetItem
from pytest_gradref.verdict.checks import ItemCheck
from pytest_gradref.verdict.tolerance_item import ToleranceItem

Item = Union[ToleranceItem, BudgetItem]


class JudgedItem(Protocol):
    """What ``check_items`` asks of an item: its numbers, then its check from them."""

    def prepare(self, statistics: bool) -> torch.Tensor | ItemCheck: ...

    def finish(self, values: Sequence[float], statistics: bool) -> ItemCheck: ...


def check_items(items: Sequence[JudgedItem], *, statistics: bool = True) -> list[ItemCheck]:
    """Compare every item, reading the host once per device whatever their number.

    Each item's verdict and statistics are computed on its device into a few float64 numbers
    (``prepare``); the numbers of all items are read to the host together (one ``tolist``,
    one sync on an accelerator), and each item judges its own (``finish``). The detail of a
    failed item (torch.testing's message, the worst element's index) is computed afterwards,
    for the failed items only. Items are not concatenated: an operation over a larger tensor
    runs on several threads on the CPU, which costs far more than it saves when other
    processes hold the cores.

    With ``statistics=False`` a tolerance check computes its verdict alone (torch.testing's
    cost), for runs that neither report nor show the statistics; a budget's statistics are
    its criterion, so they are computed either way, all but the greatest relative error,
    which a failure's message looks up. An actual result less precise than its reference
    fails on its dtype (``check_dtype``), before any statistics.
    """
    __tracebackhide__ = True
    checks: list[ItemCheck | None] = [None] * len(items)
    # Per device: the position of each item and a tensor of its numbers (float64; a bool
    # verdict for a tolerance without statistics, which the concatenation promotes).
    pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for position, item in enumerate(items):
        prepared = item.prepare(statistics)
        if isinstance(prepared, ItemCheck):
            checks[position] = prepared
        else:
            pending.setdefault(prepared.device, []).append((position, prepared))
    for group in pending.values():
        numbers = torch.cat([stats for _, stats in group]).tolist()  # the one host read
        offset = 0
        for position, stats in group:
            width = stats.numel()
            checks[position] = items[position].finish(numbers[offset : offset + width], statistics)
            offset += width
    return [check for check in checks if check is not None]
