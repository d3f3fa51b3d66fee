"""gradref_kernels: a chunked fused-linear JSD distillation loss, drop-in for Liger-Kernel's.

``fused_linear_jsd`` / ``FusedLinearJSDLoss`` mirror ``liger_fused_linear_jsd`` /
``LigerFusedLinearJSDLoss``; ``vocab_parallel_fused_linear_jsd`` /
``VocabParallelFusedLinearJSDLoss`` are the same loss with the LM heads sharded along the
vocabulary over a torch.distributed process group. The plain-PyTorch reference the tests
compare against lives in ``gradref_kernels.reference``.
"""

from .fused_linear_jsd import FusedLinearJSDLoss, fused_linear_jsd
from .vocab_parallel_jsd import VocabParallelFusedLinearJSDLoss, vocab_parallel_fused_linear_jsd

__all__ = [
    "FusedLinearJSDLoss",
    "VocabParallelFusedLinearJSDLoss",
    "fused_linear_jsd",
    "vocab_parallel_fused_linear_jsd",
]
