"""Sharded gradients: the reference on the full tensors, each rank's local gradients compared
with their slice of it, under the usual rules, and each item labelled with its rank.

The slicing is tested in this process (a RankGradReference of rank 1 of 2 needs no process
group); one generated run checks it in real ranks, with DTensors and the report."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_gradref.config.tolerances import DEFAULT_BUDGET, CheckPolicy
from pytest_gradref.ranks.sharding import Cut, RankGradReference
from pytest_gradref.reference.grad_reference import GradReference
from pytest_gradref.reference.recording import Recording


def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.T).square().sum()


def _rank(rank: int, world_size: int = 2) -> RankGradReference:
    base = GradReference(
        strategy="autograd",
        default_strategy="autograd",
        policy=CheckPolicy(
            backend="cpu", default_golden=torch.float64, default_budget=DEFAULT_BUDGET
        ),
        recording=Recording(),
    )
    return RankGradReference.for_rank(base, rank, world_size)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=generator)
    w = torch.randn(6, 8, generator=generator)
    return x, w


def _local_grads(
    x: torch.Tensor, w_local: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's loss and gradients, as a vocabulary-parallel kernel computes them before
    its all-reduces; the tests add the other rank's share themselves."""
    xx, ww = x.clone().requires_grad_(), w_local.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    assert xx.grad is not None
    assert ww.grad is not None
    return out.detach(), xx.grad, ww.grad


@pytest.mark.parametrize(
    ("size", "count", "pieces"),
    [(6, 2, [(0, 3), (3, 6)]), (5, 2, [(0, 3), (3, 5)]), (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)])],
)
def test_cuts_follow_dtensor_shard(size: int, count: int, pieces: list[tuple[int, int]]) -> None:
    # torch.chunk's pieces of ceil(size / count), the last ones shorter or empty.
    assert [Cut(0, i, count).bounds(size) for i in range(count)] == pieces
    whole = torch.arange(size)
    assert [Cut(0, i, count).apply(whole).tolist() for i in range(count)] == [
        list(range(a, b)) for a, b in pieces
    ]


def test_each_rank_compares_its_slice_of_the_full_reference() -> None:
    x, w = _inputs()
    values, x_grads, w_grads = zip(*(_local_grads(x, w.chunk(2)[r]) for r in range(2)))
    total, gx = sum(values), sum(x_grads)
    for rank in range(2):
        ref = _rank(rank)(loss, x, w, argnums=(0, 1), shards={"w": 0})
        assert ref.grads[1].shape == (6, 8)  # the reference is the full one
        assert ref.local.grads[1].shape == (3, 8)
        ref.assert_close(total, (gx, w_grads[rank]))
        labels = [check.label for check in ref.recording.checks]  # type: ignore[union-attr]
        start, end = 3 * rank, 3 * rank + 3
        assert labels == [
            "value",
            "gradient of argument 0 (x)",
            f"gradient of argument 1 (w), shard {rank} of 2 along dim 0 [{start}:{end}]",
        ]


def test_a_wrong_shard_fails_naming_the_slice() -> None:
    x, w = _inputs()
    values, x_grads, w_grads = zip(*(_local_grads(x, w.chunk(2)[r]) for r in range(2)))
    ref = _rank(1)(loss, x, w, argnums=(0, 1), shards={1: 0})
    # Judged by the numbers (not a shape mismatch): the slice has the shard's shape.
    slice_failed = (
        r"\(w\), shard 1 of 2 along dim 0 \[3:6\]:\n +greatest error vs the float64 golden"
    )
    with pytest.raises(AssertionError, match=slice_failed):
        ref.assert_close(sum(values), (sum(x_grads), w_grads[0]))  # rank 0's shard


def test_a_forgotten_shard_spec_says_how_to_give_it() -> None:
    x, w = _inputs()
    value, gx, gw = _local_grads(x, w.chunk(2)[1])
    ref = _rank(1)(loss, x, w, argnums=(0, 1))
    with pytest.raises(ValueError, match=r"grad_reference\(\.\.\., shards=\{'w': 0\}\)"):
        ref.assert_close(value, (gx, gw))


def test_an_unnamed_argument_is_suggested_by_its_argnums_position() -> None:
    # Only w (position 1) is differentiated, and the function's signature names nothing: the
    # suggestion is the argument's position in the call, not its place among the gradients.
    x, w = _inputs()
    _, _, gw = _local_grads(x, w.chunk(2)[1])
    value = loss(x, w)
    ref = _rank(1)(lambda *tensors: loss(*tensors), x, w, argnums=1)
    with pytest.raises(ValueError, match=r"grad_reference\(\.\.\., shards=\{1: 0\}\)"):
        ref.assert_close(value, gw)


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        (
            {"v": 0},
            r"shards=\{'v': \.\.\.\} names no gradient of this reference; its gradients "
            r"are 0 or 'x', 1 or 'w'",
        ),
        ({"w": 2}, r"shards\['w'\]=2: the gradient of argument 1 \(w\) has 2 dimension"),
        ({"w": 0, 1: 1}, r"shards= names the gradient of argument 1 \(w\) twice"),
        ({"w": "rows"}, r"shards\['w'\] is 'rows'; shards= maps an argument"),
        ({"w": (0, None)}, r"is a placement per device mesh dimension: pass the mesh too"),
    ],
)
def test_a_bad_shard_spec_says_what_is_valid(shards: dict[object, object], message: str) -> None:
    x, w = _inputs()
    with pytest.raises(ValueError, match=message):
        _rank(0)(loss, x, w, argnums=(0, 1), shards=shards)


def test_a_cut_of_a_cut_is_named_in_the_whole_tensors_indices() -> None:
    # (Shard(0), Shard(0)) on a 2 x 2 mesh, coordinate (1, 0): rows 4:8, then the first half.
    nested = Cut(0, 1, 2, then=Cut(0, 0, 2))
    assert nested.apply(torch.arange(8)).tolist() == [4, 5]
    assert (
        nested.describe((8,))
        == "shard 1 of 2 along dim 0 [4:8] then shard 0 of 2 along dim 0 [4:6]"
    )
    across = Cut(0, 1, 2, then=Cut(1, 1, 3))
    assert across.apply(torch.arange(24).reshape(4, 6)).tolist() == [[14, 15], [20, 21]]


class Mesh2D:
    """What the sharding reads of a DeviceMesh: its dimensions, their sizes, this rank's
    coordinate (rank r of 4 at (r // 2, r % 2), row-major as init_device_mesh lays it out)."""

    ndim = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def size(self, axis: int) -> int:
        return 2

    def get_coordinate(self) -> list[int]:
        return [self.rank // 2, self.rank % 2]


def test_placements_on_a_2d_mesh_cut_by_the_ranks_coordinates() -> None:
    from torch.distributed.tensor import Replicate, Shard

    # Data parallel along the mesh's first dimension (rows of x), tensor parallel along its
    # second (rows of w): each rank compares its data rows' x gradient and its w rows' one.
    x, w = torch.randn(8, 8), torch.randn(6, 8)
    shards = {"x": (Shard(0), Replicate()), "w": (Replicate(), Shard(0))}
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        ref = _rank(rank, 4)(loss, x, w, argnums=(0, 1), shards=shards, mesh=Mesh2D(rank))
        assert torch.equal(ref.local.grads[0], ref.grads[0][4 * dp : 4 * dp + 4])
        assert torch.equal(ref.local.grads[1], ref.grads[1][3 * tp : 3 * tp + 3])
        assert ref.local.grad_labels[1] == (
            f"gradient of argument 1 (w), shard {tp} of 2 along dim 0 [{3 * tp}:{3 * tp + 3}]"
        )
    with pytest.raises(ValueError, match=r"has 1 placement\(s\) for a 2-D device mesh"):
        _rank(0, 4)(loss, x, w, argnums=(0, 1), shards={"w": (Shard(0),)}, mesh=Mesh2D(0))


def test_a_partial_placement_is_refused() -> None:
    from torch.distributed.tensor import Partial

    x, w = _inputs()
    with pytest.raises(ValueError, match=r"is Partial\(\): a partial sum on each rank"):
        _rank(0)(loss, x, w, argnums=(0, 1), shards={"w": Partial()})


def test_a_strided_shard_is_refused_with_the_fix() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    x, w = _inputs()
    strided = _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match=r"a strided shard .* gather=True"):
        _rank(0, 4)(loss, x, w, argnums=(0, 1), shards={"w": (strided, strided)}, mesh=Mesh2D(0))


def test_module_parameters_and_goldens_are_sliced_too() -> None:
    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 6, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).float().square().sum()

    torch.manual_seed(0)
    head, x = Head(), torch.randn(4, 8, dtype=torch.bfloat16)
    ref = _rank(1)(head, x, shards={"proj.weight": 0, "proj.bias": 0})
    assert ref.golden is not None  # the default verdict's float64 golden, bf16 inputs
    local = ref.local
    assert local.golden is not None
    key = "proj.weight, shard 1 of 2 along dim 0 [3:6]"
    assert local.param_grads[key].shape == local.golden.param_grads[key].shape == (3, 8)
    # The kernel: rank 1's rows of the projection, its gradients those of its rows.
    head.zero_grad()
    head(x).backward()
    grads = {
        "proj.weight": head.proj.weight.grad[3:],  # type: ignore[index]
        "proj.bias": head.proj.bias.grad[3:],  # type: ignore[index]
    }
    ref.assert_close(head(x).detach(), ref.grads, param_grads=grads)


# --- in real ranks ------------------------------------------------------------------------------

SHARDED = """
import pytest
import torch
import torch.distributed as dist


def loss(x, w):
    return torch.tanh(x @ w.T).square().sum()


# The passing tests first: a pool does not outlive a failure.
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.gradref_ranks(2)
def test_dtensor(gradref_rank, grad_reference, gather):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 8)
    w = torch.randn(6, 8)
    ref = grad_reference(loss, x, w, argnums=(0, 1))  # the placement says how w is sharded
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    out = loss(xd, wd)
    out.full_tensor().backward()
    gx = xd.grad.redistribute(mesh, [Replicate()])
    assert wd.grad.placements == (Shard(0),)
    ref.assert_close(out.full_tensor(), (gx, wd.grad), gather=gather)


@pytest.mark.parametrize("bug", ["none", "wrong_shard", "rank_1_only"])
@pytest.mark.gradref_ranks(2)
def test_vocab_parallel(gradref_rank, gradref_device, grad_reference, bug):
    # bf16 inputs: the default verdict judges each shard against the float64 golden's slice.
    x = torch.randn(4, 8, device=gradref_device, dtype=torch.bfloat16)
    w = torch.randn(6, 8, device=gradref_device, dtype=torch.bfloat16)
    ref = grad_reference(loss, x, w, argnums=(0, 1), shards={"w": 0})
    holds = gradref_rank.rank
    if bug == "wrong_shard":
        holds = 1 - holds
    xl = x.clone().requires_grad_()
    wl = w.chunk(2)[holds].clone().requires_grad_()
    out = loss(xl, wl)
    out.backward()
    total = out.detach().float()
    dist.all_reduce(total)
    gx = xl.grad.float()
    dist.all_reduce(gx)
    gw = wl.grad
    if bug == "rank_1_only" and gradref_rank.rank == 1:
        gw = gw * 1.05
    ref.assert_close(total.to(out.dtype), (gx.to(x.dtype), gw))


"""


MESH_2D = """
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def layer_loss(x, w):
    return torch.tanh(x @ w.T).square().sum()


# The failing case runs last: a pool does not outlive a failure, and four new ranks cost seconds.
@pytest.mark.gradref_ranks(4)
def test_dtensors_on_a_2d_mesh(gradref_rank, grad_reference):
    mesh = init_device_mesh("cpu", (2, 2))
    x, w = torch.randn(8, 16), torch.randn(6, 16)
    ref = grad_reference(layer_loss, x, w, argnums=(0, 1))  # the placements say the pieces
    xd = distribute_tensor(x, mesh, [Shard(0), Replicate()]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate(), Shard(0)]).requires_grad_()
    out = layer_loss(xd, wd)
    out.backward()
    gx = xd.grad.redistribute(mesh, [Shard(0), Replicate()])
    gw = wd.grad.redistribute(mesh, [Replicate(), Shard(0)])
    ref.assert_close(out.full_tensor(), (gx, gw))


@pytest.mark.parametrize("bug", ["none", "wrong_group"])
@pytest.mark.gradref_ranks(4)
def test_dp_tp_layer(gradref_rank, grad_reference, bug):
    # Data parallel along the mesh's first dimension (rows of x), tensor parallel along its
    # second (rows of w, the layer's output features).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, w = torch.randn(8, 16), torch.randn(6, 16)
    shards = {"x": (Shard(0), Replicate()), "w": (Replicate(), Shard(0))}
    ref = grad_reference(layer_loss, x, w, argnums=(0, 1), shards=shards, mesh=mesh)
    dp, tp = mesh.get_coordinate()
    xl = x.chunk(2)[dp].clone().requires_grad_()
    wl = w.chunk(2)[tp].clone().requires_grad_()
    out = layer_loss(xl, wl)
    out.backward()
    total = out.detach().clone()
    dist.all_reduce(total)
    gx = xl.grad
    dist.all_reduce(gx, group=mesh.get_group("tp"))  # every output feature's share
    gw = wl.grad
    # w's gradient sums over the data: its all-reduce belongs to the data-parallel group.
    dist.all_reduce(gw, group=mesh.get_group("tp" if bug == "wrong_group" else "dp"))
    ref.assert_close(total, (gx, gw))


"""


def test_a_dp_by_tp_layer_on_a_2d_mesh_in_four_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mesh=MESH_2D)
    result = pytester.runpytest(
        "-p", "no:randomly", "--gradref-report=report.json", "--gradref-device=cpu"
    )
    result.assert_outcomes(passed=2, failed=1)
    # The w gradient reduced over the tensor-parallel group is wrong on every rank.
    result.stdout.fnmatch_lines(
        [
            "*_ test_dp_tp_layer[[]wrong_group[]] _*",
            "gradref_ranks(4) on cpu (gloo): rank ? failed (AssertionError); *",
            "E       - gradient of argument 1 (w), shard ? of 2 along dim 0 [[]?:?[]]:",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    tests = {test["nodeid"].partition("::")[2]: test for test in report["tests"]}
    failed = {
        item["label"]
        for item in tests["test_dp_tp_layer[wrong_group]"]["items"]
        if not item["passed"]
    }
    assert failed == {
        f"rank {rank}: gradient of argument 1 (w), shard {rank % 2} of 2 along dim 0 "
        f"[{3 * (rank % 2)}:{3 * (rank % 2) + 3}]"
        for rank in range(4)
    }
    for name in ("test_dp_tp_layer[none]", "test_dtensors_on_a_2d_mesh"):
        labels = [item["label"] for item in tests[name]["items"]]
        assert labels == [
            f"rank {rank}: {what}"
            for rank in range(4)
            for what in (
                "value",
                f"gradient of argument 0 (x), shard {rank // 2} of 2 along dim 0 "
                f"[{4 * (rank // 2)}:{4 * (rank // 2) + 4}]",
                f"gradient of argument 1 (w), shard {rank % 2} of 2 along dim 0 "
                f"[{3 * (rank % 2)}:{3 * (rank % 2) + 3}]",
            )
        ], name


def test_sharded_gradients_in_two_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_sharded=SHARDED)
    result = pytester.runpytest(
        "-p", "no:randomly", "--gradref-report=report.json", "--gradref-device=cpu"
    )
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_vocab_parallel[[]wrong_shard[]] _*",
            "gradref_ranks(2) on cpu (gloo): rank ? failed (AssertionError); rank ? failed *",
        ]
    )
    # A bug only one rank sees fails the test on that rank, naming its slice.
    result.stdout.fnmatch_lines(
        [
            "*_ test_vocab_parallel[[]rank_1_only[]] _*",
            "gradref_ranks(2) on cpu (gloo): rank 1 failed (AssertionError); rank 0 passed",
            "*_ rank 1 of 2 on cpu: failed _*",
            ">       ref.assert_close(total.to(out.dtype), (gx.to(x.dtype), gw))",
            "E       AssertionError: Reference mismatch on cpu (cpu backend, autograd "
            "reference): 1 of 3 items differ",
            "E       - gradient of argument 1 (w), shard 1 of 2 along dim 0 [[]3:6[]]:",
            "E           greatest error vs the float64 golden: *",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    tests = {test["nodeid"].partition("::")[2]: test for test in report["tests"]}
    # Every rank's items reach the report, labelled with the rank.
    labels = [item["label"] for item in tests["test_vocab_parallel[rank_1_only]"]["items"]]
    assert labels == [
        "rank 0: value",
        "rank 0: gradient of argument 0 (x)",
        "rank 0: gradient of argument 1 (w), shard 0 of 2 along dim 0 [0:3]",
        "rank 1: value",
        "rank 1: gradient of argument 0 (x)",
        "rank 1: gradient of argument 1 (w), shard 1 of 2 along dim 0 [3:6]",
    ]
    passed = [item["passed"] for item in tests["test_vocab_parallel[rank_1_only]"]["items"]]
    assert passed == [True] * 5 + [False]
    criterion = tests["test_vocab_parallel[none]"]["items"][2]["criterion"]
    assert criterion.startswith("budget 2x the bfloat16 reference's error vs the float64 golden")
    # The ranks drew the same full inputs (one seed): their references' fingerprints agree.
    inputs = tests["test_vocab_parallel[none]"]["inputs"]
    assert len(inputs) == 2
    assert inputs[0] == inputs[1]
    shard_by_shard = [item["label"] for item in tests["test_dtensor[False]"]["items"]]
    assert "rank 1: gradient of argument 1 (w), shard 1 of 2 along dim 0 [3:6]" in shard_by_shard
    gathered = [item["label"] for item in tests["test_dtensor[True]"]["items"]]
    assert "rank 1: gradient of argument 1 (w)" in gathered
