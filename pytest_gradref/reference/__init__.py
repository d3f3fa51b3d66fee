"""The reference: the object the ``grad_reference`` fixture hands a test and the ``Reference``
it returns, their computation (the differentiation strategies, the golden, the rounded
reference and its spread, auxiliary outputs), the inputs' fingerprints, and what one test's
references recorded.

Imports config and verdict at load. Loads torch, but for ``inputs`` and
``hypothesis_examples``.
"""
