"""The loss options as one object, which the public API hands to the autograd Function, the
chunk loop and the per-chunk functions (``_chunk_torch``, ``_chunk_triton``)."""

from __future__ import annotations

from dataclasses import dataclass

# The options as the custom operator takes them: its schema spells them out, in field order,
# since an operator's arguments cannot be Python objects.
OpArgs = tuple[float, float, int, float, float, bool]


@dataclass(frozen=True)
class LossOptions:
    """The options of one loss call, checked by the public API before they get here."""

    beta: float
    """Weight of the teacher in the mixture, in [0, 1]; 0 is KL(T||S), 1 is KL(S||T)."""

    temperature: float
    """Positive; scales both logits for the soft loss only."""

    ignore_index: int
    """Label value of rows that are left out of both losses."""

    weight_hard: float
    """Weight of the hard (cross-entropy) loss in the loss and its gradient."""

    weight_soft: float
    """Weight of the soft (JSD) loss in the loss and its gradient."""

    compute_hard: bool
    """Whether to compute the hard loss (and its gradient) at all: its weight is nonzero, or it
    is returned."""

    def shares_softmax(self, vocab_s: int, vocab_t: int) -> bool:
        """Whether the hard loss's softmax(z) is S itself: no temperature scaling and no
        padding of the student logits to a wider teacher vocabulary."""
        return self.temperature == 1.0 and vocab_t == vocab_s

    def as_op_args(self) -> OpArgs:
        """The options as the custom operator's arguments, in field order."""
        return (
            self.beta,
            self.temperature,
            self.ignore_index,
            self.weight_hard,
            self.weight_soft,
            self.compute_hard,
        )

    @classmethod
    def from_op_args(cls, args: OpArgs) -> LossOptions:
        """The options back from the custom operator's arguments (:meth:`as_op_args`)."""
        return cls(*args)
