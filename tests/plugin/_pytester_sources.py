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


# A fixture that counts the calls reading a tensor's values to the host, each a sync on an
# accelerator: the cost guards of assert_close and the crosscheck count them.
HOST_READS_FIXTURE = """
import pytest
import torch

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    \"\"\"Counts the calls that read a tensor's values to the host (a sync on an accelerator).\"\"\"
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(*args, _original=original, **kwargs):
            count[0] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count
"""


# Rank 1 fails before the all-reduce that rank 0 waits in: spawned ranks (test_ranks.py) and
# the launcher's (test_launcher.py) must both end such a test within seconds.
PEER_FAILS_FIRST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.gradref_ranks(2)
def test_rank_1_fails_first(gradref_rank):
    assert gradref_rank.rank == 0, "rank 1 fails before the all-reduce"
    dist.all_reduce(torch.ones(1))
"""
