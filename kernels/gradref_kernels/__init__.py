"""gradref_kernels: a chunked fused-linear JSD distillation loss, drop-in for Liger-Kernel's.

``fused_linear_jsd`` / ``FusedLinearJSDLoss`` mirror ``liger_fused_linear_jsd`` /
``LigerFusedLinearJSDLoss``; the plain-PyTorch reference the tests compare against lives in
``gradref_kernels.reference``.
"""

from .fused_linear_jsd import FusedLinearJSDLoss, fused_linear_jsd

__all__ = ["FusedLinearJSDLoss", "fused_linear_jsd"]
