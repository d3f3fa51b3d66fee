"""The verdict: the items a test compares, their checks and failure messages, and the precision
of dtypes they are judged at.

Imports config at load (the tolerances and the criteria's constants). Loads torch.
"""
