"""Source text shared by the pytester files of several plugin tests."""

# A kernel in the old autograd.Function style: forward takes ctx and there is no
# setup_context, so torch.func cannot differentiate it; its backward is the exact 2x.
OLD_STYLE_SQUARE = """
import pytest
import torch


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad
"""
