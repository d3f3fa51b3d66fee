"""The launcher mode on a GPU: run by hand under torchrun, one rank per GPU, e.g.

    torchrun --nproc-per-node=1 --max-restarts=0 -m pytest -p no:randomly \
        benchmarks/nccl_launcher/test_launcher_nccl.py --gradref-report=report.json

(results: benchmarks/results/h100/launcher_nccl.txt). The test command does not collect it
(testpaths is tests/); on a host without CUDA it skips.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL")


def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.T).square().sum()


@pytest.mark.gradref_ranks(int(os.environ.get("WORLD_SIZE", "1")))  # every rank torchrun starts
def test_a_vocabulary_parallel_head_on_nccl(
    gradref_rank: Any, gradref_device: torch.device, grad_reference: Any
) -> None:
    assert gradref_rank.collective == "nccl"
    assert gradref_device.type == "cuda"
    x = torch.randn(32, 64, device=gradref_device)
    w = torch.randn(96, 64, device=gradref_device)
    ref = grad_reference(loss, x, w, argnums=(0, 1), shards={"w": 0})
    xl = x.clone().requires_grad_()
    wl = gradref_rank.shard(w).requires_grad_()
    out = loss(xl, wl)
    out.backward()
    total = out.detach()
    dist.all_reduce(total, group=gradref_rank.group)
    assert xl.grad is not None
    dist.all_reduce(xl.grad, group=gradref_rank.group)
    ref.assert_close(total, (xl.grad, wl.grad))


def test_unmarked_runs_on_every_rank(gradref_device: torch.device, grad_reference: Any) -> None:
    x = torch.randn(16, 8, device=gradref_device)
    ref = grad_reference(lambda t: t.exp().sum(), x)
    y = x.clone().requires_grad_()
    out = y.exp().sum()
    out.backward()
    ref.assert_close(out, y.grad)
