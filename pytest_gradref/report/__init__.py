"""The report: the precision report's writer, the comparison of two reports and its output,
the baseline gate, and which tests ran on the gradref device.

Imports config and reference (the inputs' fingerprints) at load. Loads no torch: ``diff`` and
``diff_output`` import neither torch nor pytest, so ``pytest-gradref diff`` starts fast.
"""
