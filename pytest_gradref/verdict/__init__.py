"""The verdict: the choice of criterion (criterion.py), the items a test compares, each kind
judging itself (tolerance_item.py, budget_item.py), their one judge (judge.py), their checks
and failure messages, and the precision of dtypes they are judged at.

Imports config at load (the tolerances, the check policy and the criteria's constants). Loads
torch.
"""
