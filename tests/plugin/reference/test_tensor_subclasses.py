"""Tensor subclasses as actual results, references and inputs: DTensor and a wrapper subclass.

A subclass cannot be read to the host in bulk, so its items leave the one-read batched pass of
``judge.check_items`` and are compared one by one; these tests prove that every route
(tolerance, budget against a golden, crosscheck, the report) gets there and still fails when
it should. The tolerance route is the tolerance verdict's: under the default verdict the
float32 tests of the tolerance route are judged by an automatic float64 golden instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _forked_runs import runpytest_forked

# The checks every subclass must pass, written once; the generated module defines ``wrap``
# (a plain tensor to the subclass) and ``SUBCLASS`` (the type every result must keep).
CHECKS = """
import pytest
import torch


def loss(x, w):
    # x @ w, written without the matrix-vector product, which torch 2.6's DTensor lacks
    return (x * w).sum(-1).sin().sum()


def kernel(x, w):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    value = loss(x, w)
    value.backward()
    return value, x.grad, w.grad


def inputs():
    return wrap(torch.randn(8, 5)), wrap(torch.randn(5))


def test_tolerance(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert type(ref.value) is SUBCLASS and type(ref.grads[0]) is SUBCLASS
    value, gx, gw = kernel(x, w)
    assert type(gx) is SUBCLASS
    ref.assert_close(value, (gx, gw))


def test_tolerance_mismatch_fails(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    value, gx, gw = kernel(x, w)
    with pytest.raises(AssertionError, match="1 of 3 items differ") as failure:
        ref.assert_close(value, (gx, gw * 1.01))
    assert "gradient of argument 1 (w)" in str(failure.value)


@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_budget(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert ref.golden.value.dtype == torch.float64
    value, gx, gw = kernel(x, w)
    ref.assert_close(value, (gx, gw))
    with pytest.raises(AssertionError, match="error vs the float64 golden"):
        ref.assert_close(value + 1e-3, (gx, gw))


def upcast_loss(x, w):
    # float32 inside from bf16 inputs, as library references compute
    return loss(*(t.to(torch.promote_types(t.dtype, torch.float32)) for t in (x, w)))


# The kernel computes in bf16 throughout and returns its loss in bf16, on purpose.
@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)
def test_rounded_budget(grad_reference):
    x, w = (wrap(t.to(torch.bfloat16)) for t in (torch.randn(8, 5), torch.randn(5)))
    ref = grad_reference(upcast_loss, x, w, argnums=(0, 1))
    assert type(ref.rounded.value) is SUBCLASS and type(ref.rounded.arg_grads[1]) is SUBCLASS
    value, gx, gw = kernel(x, w)  # in bf16 throughout
    ref.assert_close(value, (gx, gw))
    with pytest.raises(AssertionError, match="the bfloat16-rounded reference's"):
        ref.assert_close(value, (gx, gw * 1.5))


@pytest.mark.gradref(strategy="crosscheck")
def test_crosscheck(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert [d.label for d in ref.crosscheck] == [
        "value", "gradient of argument 0 (x)", "gradient of argument 1 (w)"
    ]
    assert not any(d.exceeds_tolerance for d in ref.crosscheck)
    ref.assert_close(*kernel(x, w)[:1], kernel(x, w)[1:])


# One side a subclass, the other plain; both of one kind are the tests above.
MIXED = pytest.mark.parametrize(
    "reference_kind, actual_kind", [("subclass", "plain"), ("plain", "subclass")]
)


def as_kind(tensor, kind):
    return wrap(tensor) if kind == "subclass" else tensor


@MIXED
def test_mixed_tolerance(grad_reference, reference_kind, actual_kind):
    x, w = torch.randn(8, 5), torch.randn(5)
    ref = grad_reference(
        loss, as_kind(x, reference_kind), as_kind(w, reference_kind), argnums=(0, 1)
    )
    value, gx, gw = kernel(as_kind(x, actual_kind), as_kind(w, actual_kind))
    assert type(ref.value) is not type(value)
    ref.assert_close(value, (gx, gw))
    with pytest.raises(AssertionError, match="1 of 3 items differ") as failure:
        ref.assert_close(value, (gx, gw * 1.01))
    assert "gradient of argument 1 (w)" in str(failure.value)


@MIXED
@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_mixed_budget(grad_reference, reference_kind, actual_kind):
    x, w = torch.randn(8, 5), torch.randn(5)
    ref = grad_reference(
        loss, as_kind(x, reference_kind), as_kind(w, reference_kind), argnums=(0, 1)
    )
    value, gx, gw = kernel(as_kind(x, actual_kind), as_kind(w, actual_kind))
    assert type(ref.golden.value) is not type(value)
    ref.assert_close(value, (gx, gw))
    with pytest.raises(AssertionError, match="error vs the float64 golden"):
        ref.assert_close(value + 1e-3, (gx, gw))


def test_plain_actual_against_plain_reference_still_batched(grad_reference):
    x, w = torch.randn(8, 5), torch.randn(5)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    value, gx, gw = kernel(x, w)
    ref.assert_close(value, (gx, gw))
"""

# A wrapper subclass as a backend or a test would write one: it holds a plain tensor, runs
# every operation on it and wraps the results.
WRAPPER = """
import torch
from torch.utils._pytree import tree_map


class Wrapped(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self):
        return f"Wrapped({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.inner if isinstance(t, Wrapped) else t

        def rewrap(t):
            return Wrapped(t) if isinstance(t, torch.Tensor) else t

        return tree_map(rewrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Wrapped(inner_tensors["inner"])


SUBCLASS = Wrapped
wrap = Wrapped
"""

# DTensor on a one-rank gloo group in the child process, through a file store: no port to
# find, and the process group dies with the child.
DTENSOR = """
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

MESH = []


@pytest.fixture(scope="module", autouse=True)
def one_rank_mesh(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    MESH.append(init_device_mesh("cpu", (1,)))
    yield
    dist.destroy_process_group()


SUBCLASS = DTensor


def wrap(tensor):
    # Matrices sharded by rows, vectors replicated: the layout the issue's report used.
    placement = Shard(0) if tensor.dim() > 1 else Replicate()
    return distribute_tensor(tensor, MESH[0], [placement])
"""

OUTCOMES = {"passed": 10}
MIXED = ("subclass-plain", "plain-subclass")  # the ids of CHECKS' mixed cases


def _check_report(path: Path, verdict: str = "tolerance") -> None:
    """Every test has its three items with finite statistics, and the crosscheck its three;
    the tests without a marker are judged by the verdict's rule."""
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads(path.read_text())["tests"]}
    assert set(tests) == {
        "test_tolerance",
        "test_tolerance_mismatch_fails",
        "test_budget",
        "test_rounded_budget",
        "test_crosscheck",
        "test_plain_actual_against_plain_reference_still_batched",
        *(f"test_mixed_{check}[{kinds}]" for check in ("tolerance", "budget") for kinds in MIXED),
    }
    tolerance = tests["test_tolerance"]["items"]
    assert [i["label"] for i in tolerance] == [
        "value",
        "gradient of argument 0 (x)",
        "gradient of argument 1 (w)",
    ]
    assert all(i["passed"] and 0 < i["headroom"] <= 1 for i in tolerance)
    mismatch = tests["test_tolerance_mismatch_fails"]["items"]
    assert [i["passed"] for i in mismatch] == [True, True, False]
    assert mismatch[2]["max_rel"] == pytest.approx(0.01, rel=1e-3)
    budget = tests["test_budget"]["items"]
    assert [i["passed"] for i in budget] == [True, True, True, False, True, True]
    assert all("budget 2x" in i["criterion"] for i in budget)
    rounded = tests["test_rounded_budget"]["items"]
    assert [i["passed"] for i in rounded] == [True, True, True, True, True, False]
    assert all(i["rounded_error"] >= 0 and "bfloat16-rounded" in i["criterion"] for i in rounded)
    assert len(tests["test_crosscheck"]["crosscheck"]) == 3
    judged_by = "rtol=" if verdict == "tolerance" else "budget 2x the float32 reference's"
    unmarked = ["test_tolerance", "test_tolerance_mismatch_fails"]
    unmarked += [f"test_mixed_tolerance[{kinds}]" for kinds in MIXED]
    for name in unmarked:
        assert all(i["criterion"].startswith(judged_by) for i in tests[name]["items"]), name
    for kinds in MIXED:
        mixed = tests[f"test_mixed_tolerance[{kinds}]"]["items"]
        assert [i["passed"] for i in mixed] == [True] * 5 + [False]
        assert mixed[5]["max_rel"] == pytest.approx(0.01, rel=1e-3)
        mixed_budget = tests[f"test_mixed_budget[{kinds}]"]["items"]
        assert [i["passed"] for i in mixed_budget] == [True, True, True, False, True, True]


@pytest.mark.parametrize("verdict", ["tolerance", "golden"])
def test_a_wrapper_subclass_takes_every_route(pytester: pytest.Pytester, verdict: str) -> None:
    pytester.makepyfile(test_wrapped=WRAPPER + CHECKS)
    result = pytester.runpytest(
        "--gradref-device=cpu", "--gradref-report=report.json", f"--gradref-verdict={verdict}"
    )
    result.assert_outcomes(**OUTCOMES)
    _check_report(pytester.path / "report.json", verdict)


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no gloo process groups",
)
def test_dtensor_on_a_one_rank_gloo_mesh_takes_every_route(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_dtensor=DTENSOR + CHECKS)
    # A child process: the process group and the mesh are process-wide. The tolerance verdict:
    # torch.testing's route, which torch 2.6 cannot take on a DTensor (tolerance_item.py); the
    # golden route is the marked budget tests'.
    result = runpytest_forked(
        pytester,
        "--gradref-device=cpu",
        "--gradref-report=report.json",
        "--gradref-verdict=tolerance",
    )
    result.assert_outcomes(**OUTCOMES)
    _check_report(pytester.path / "report.json")
