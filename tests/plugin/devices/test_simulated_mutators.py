"""What training code does to tensors and parameters, on the simulated npu: each mutator
works as on a device (the values of the same sequence run on the CPU) or raises an error that
names the operation, never leaves a stale value.

A walk (Hypothesis, derandomized) applies sequences of module and tensor mutators to a world
on the CPU and the same world on the simulated npu, and compares every tensor after every
step. Installing the simulation is process-global, so the walk runs in a subprocess.
"""

from __future__ import annotations

import pytest
import torch
from _forked_runs import runpytest_forked

from pytest_gradref.devices import simulated

SIM = ("--gradref-simulate=npu", "--gradref-device=npu", "-p", "no:randomly")
# Skipped, with the reason, where torch is too old for the simulation (CI's lower bounds).
needs_simulation = pytest.mark.skipif(
    simulated.unsupported_reason() is not None, reason=str(simulated.unsupported_reason())
)

WALK = '''
import copy
import io
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.nn.utils import parametrize


def values(shape, k):
    n = math.prod(shape)
    return torch.arange(n, dtype=torch.float32).reshape(shape) * 0.25 - k


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 1.5


class World:
    """A module, its optimizer and a free tensor on ``home``; ``other`` is a second device."""

    def __init__(self, home, other):
        torch.manual_seed(0)
        self.home, self.other = torch.device(home), torch.device(other)
        self.module = torch.nn.Linear(3, 2).to(self.home)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=0.1)
        self.free = values((2, 3), 7).to(self.home)
        self.k = 0

    def fresh(self, shape, device):
        """New values (different at every call), on ``device``."""
        self.k += 1
        return values(tuple(shape), self.k).to(device)

    def weight(self):
        """The weight parameter itself, parametrized or not."""
        if parametrize.is_parametrized(self.module, "weight"):
            return self.module.parametrizations.weight.original
        return self.module.weight

    def new_optimizer(self):
        """An optimizer of the module's current parameters that carries the old state."""
        optimizer = torch.optim.Adam(self.module.parameters(), lr=0.1)
        optimizer.load_state_dict(self.optimizer.state_dict())
        self.optimizer = optimizer


def data_same_device(w):
    w.weight().data = w.fresh((2, 3), w.home)


def data_on_cpu_module_then_move(w):
    # How kernel libraries fill their heads: a module made on the CPU takes device data.
    w.module.cpu()
    w.weight().data = w.fresh((2, 3), w.home)
    w.module.bias.data = w.fresh((2,), w.home)
    w.module.to(w.home)


def data_to_cpu_then_move_back(w):
    w.weight().data = w.fresh((2, 3), "cpu")
    w.module.to(w.home)


def to_double(w):
    w.module.double()


def to_float(w):
    w.module.float()


def other_device_round_trip(w):
    w.module.to(w.other)
    w.module.to(w.home)


def copy_from_cpu(w):
    with torch.no_grad():
        w.weight().copy_(w.fresh((2, 3), "cpu"), non_blocking=True)


def copy_from_other_device(w):
    with torch.no_grad():
        w.weight().copy_(w.fresh((2, 3), w.other), non_blocking=True)


def copy_through_pinned_memory(w):
    pinned = torch.empty(2, 3).pin_memory()
    assert pinned.is_pinned()
    pinned.copy_(w.weight(), non_blocking=True)
    w.free.copy_(pinned.reshape(w.free.shape).to(w.home, non_blocking=True) * 2)


def set_tensor(w):
    with torch.no_grad():
        w.weight().set_(w.fresh((2, 3), w.home))


def set_storage(w):
    source = w.fresh((6,), w.home)
    w.free.set_(source.untyped_storage(), 0, (3, 2), (2, 1))


def load_state_dict_from_cpu(w):
    state = {k: w.fresh(v.shape, "cpu") for k, v in w.module.state_dict().items()}
    w.module.load_state_dict(state)


def load_state_dict_assign(w):
    state = {k: w.fresh(v.shape, w.home) for k, v in w.module.state_dict().items()}
    w.module.load_state_dict(state, assign=True)
    w.new_optimizer()


def register_buffer(w):
    w.module.register_buffer("scale", w.fresh((2,), w.home))
    w.module.scale.mul_(2)


def parametrize_weight(w):
    if not parametrize.is_parametrized(w.module, "weight"):
        parametrize.register_parametrization(w.module, "weight", Scale())
    w.weight().data = w.fresh((2, 3), w.home)


def optimizer_step(w):
    w.optimizer.zero_grad()
    loss = w.module(w.fresh((4, 3), w.home).to(w.weight().dtype)).square().sum()
    if hasattr(w.module, "scale"):
        loss = loss + w.module.scale.sum()
    loss.backward()
    w.optimizer.step()


def optimizer_state_round_trip(w):
    w.optimizer.load_state_dict(copy.deepcopy(w.optimizer.state_dict()))


def checkpoint_to_cpu(w):
    buffer = io.BytesIO()
    torch.save({"model": w.module.state_dict(), "optim": w.optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, map_location="cpu")
    assert all(v.device.type == "cpu" for v in checkpoint["model"].values())
    w.module.load_state_dict(checkpoint["model"])
    w.optimizer.load_state_dict(checkpoint["optim"])


def checkpoint_to_device(w):
    buffer = io.BytesIO()
    torch.save(w.module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location=str(w.home))
    assert all(v.device == w.home for v in state.values())
    w.module.load_state_dict(state, assign=True)
    w.new_optimizer()


def deepcopy_module(w):
    w.module = copy.deepcopy(w.module)
    w.new_optimizer()


def swap_free(w):
    torch.utils.swap_tensors(w.free, w.fresh(w.free.shape, w.home))


def metadata_in_place(w):
    w.free.resize_(2, 3).t_()


def grad_data(w):
    if w.weight().grad is not None:
        w.weight().grad.data = w.fresh((2, 3), w.home)


def free_arithmetic(w):
    w.free.mul_(2).add_(w.fresh(w.free.shape, w.home))


def free_data_to_cpu_and_back(w):
    w.free.data = w.fresh(w.free.shape, "cpu")
    w.free.data = w.free.data.to(w.home)


STEPS = {
    step.__name__: step
    for step in (
        data_same_device,
        data_on_cpu_module_then_move,
        data_to_cpu_then_move_back,
        to_double,
        to_float,
        other_device_round_trip,
        copy_from_cpu,
        copy_from_other_device,
        copy_through_pinned_memory,
        set_tensor,
        set_storage,
        load_state_dict_from_cpu,
        load_state_dict_assign,
        register_buffer,
        parametrize_weight,
        optimizer_step,
        optimizer_state_round_trip,
        checkpoint_to_cpu,
        checkpoint_to_device,
        deepcopy_module,
        swap_free,
        metadata_in_place,
        grad_data,
        free_arithmetic,
        free_data_to_cpu_and_back,
    )
}


def tensors(w):
    """Every tensor of the world, by name, and the device each belongs on."""
    found = {f"module {k}": (v, w.home) for k, v in w.module.state_dict().items()}
    for name, p in w.module.named_parameters():
        assert isinstance(p, torch.nn.Parameter), name
        found[f"parameter {name}"] = (p, w.home)
        if p.grad is not None:
            found[f"grad {name}"] = (p.grad, w.home)
    for i, state in enumerate(w.optimizer.state.values()):
        for key, value in state.items():
            # Adam keeps its step count on the CPU (not capturable).
            found[f"optimizer {i} {key}"] = (value, w.home if key != "step" else value.device)
    found["free"] = (w.free, w.home)
    return found


def assert_same(on_cpu, on_npu, done):
    expected, actual = tensors(on_cpu), tensors(on_npu)
    assert sorted(actual) == sorted(expected), done
    for name, (value, device) in actual.items():
        reference = expected[name][0]
        assert value.device == device, f"after {done}: {name} is on {value.device}"
        assert (value.dtype, value.shape) == (reference.dtype, reference.shape), (done, name)
        assert torch.equal(value.detach().cpu(), reference.detach()), f"after {done}: {name}"


def raised(step, world):
    try:
        step(world)
    except Exception as error:
        return type(error)
    return None


def walk(names):
    """Each step on both worlds: the same values after it, or the same error from both (an
    optimizer step on a dtype it has no state for); whether every step ran."""
    on_cpu, on_npu = World("cpu", "cpu"), World("npu:0", "npu:1")
    for i, name in enumerate(names):
        done = names[: i + 1]
        errors = raised(STEPS[name], on_cpu), raised(STEPS[name], on_npu)
        assert errors[1] is errors[0], f"after {done}: CPU raised {errors[0]}, npu {errors[1]}"
        if errors[0] is not None:
            return False
        assert_same(on_cpu, on_npu, done)
    return True


@pytest.mark.parametrize("name", sorted(STEPS))
def test_each_mutator_alone(name):
    assert walk([name, "optimizer_step", name]), "each mutator works on its own"


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(st.sampled_from(sorted(STEPS)), min_size=2, max_size=6))
def test_sequences_of_mutators(names):
    walk(names)
'''

CASES = """
import copy
import io

import pytest
import torch
from pytest_gradref.devices.simulated_devices import SimulatedDeviceError

NPU, NPU1 = torch.device("npu", 0), torch.device("npu", 1)


def test_data_on_an_npu_parameter_replaces_its_values():
    head = torch.nn.Linear(3, 2).to(NPU)
    head.weight.data = torch.arange(6.0, device=NPU).reshape(2, 3)
    assert head.weight.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    head.weight.data = torch.ones(4, 3, dtype=torch.float64, device=NPU1)  # any shape, dtype
    assert (head.weight.shape, head.weight.dtype, head.weight.device) == (
        (4, 3), torch.float64, NPU1
    )
    assert (head.weight * 2).cpu().sum().item() == 24.0


def test_heads_on_the_cpu_filled_with_npu_data():
    # The kernel library's pattern: both heads share the tensor, as on a real device.
    torch_head, kernel_head = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    weight = torch.randn(2, 3, device=NPU)
    torch_head.weight.data = kernel_head.weight.data = weight
    for head in (torch_head, kernel_head):
        assert isinstance(head.weight, torch.nn.Parameter) and head.weight.device == NPU
        assert head.weight.requires_grad and head.weight.is_leaf
    weight.mul_(2)  # .data = shares the tensor's data
    assert torch.equal(torch_head.weight.cpu(), weight.cpu())
    x = torch.randn(4, 3, device=NPU)
    torch_head.bias.data = torch.zeros(2, device=NPU)
    torch_head(x).sum().backward()
    assert torch_head.weight.grad.device == NPU
    assert torch.allclose(torch_head.weight.grad.cpu(), x.cpu().sum(0).expand(2, 3))


def test_an_npu_parameter_given_cpu_data_moves_to_the_cpu():
    head = torch.nn.Linear(3, 2).to(NPU)
    weight = head.weight
    head.weight.data = torch.ones(2, 3)
    assert head.weight is weight and isinstance(weight, torch.nn.Parameter)
    assert weight.device.type == "cpu" and weight.sum().item() == 6.0


def test_module_moves_keep_the_parameters_an_optimizer_holds():
    head = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(head.parameters(), lr=1.0)
    head.to(NPU)
    head(torch.ones(1, 3, device=NPU)).sum().backward()
    before = head.weight.detach().cpu()
    optimizer.step()
    assert torch.equal(head.weight.cpu(), before - 1.0)
    # One that something else holds (a live autograd graph) cannot move in place: the module
    # gets a new parameter, as torch gives one where it cannot copy into a tensor.
    held = torch.nn.Linear(3, 2)
    weight, out = held.weight, held(torch.ones(1, 3))
    held.to(NPU)
    assert held.weight is not weight and held.weight.device == NPU
    out.sum().backward()
    assert weight.device.type == "cpu" and weight.grad is not None


def test_moves_that_cannot_be_in_place_say_so():
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.register_hook(lambda grad: grad)
    with pytest.raises(SimulatedDeviceError, match="a cpu tensor given npu:0 data.*no grad_fn"):
        weight.data = torch.ones(2, device=NPU)
    held = torch.nn.Parameter(torch.zeros(2))
    view = held[:1]
    with pytest.raises(SimulatedDeviceError, match="only where nothing else holds it"):
        held.data = torch.ones(2, device=NPU)
    assert held.device.type == "cpu" and view.device.type == "cpu"


def test_copies_stay_on_the_device():
    x = torch.arange(3.0, device=NPU1)
    x.note = "kept"
    shallow = copy.copy(x)
    shallow.add_(1)  # shares the data, as torch's shallow copy of a tensor does
    assert (shallow.device, shallow.note, x.cpu().tolist()) == (NPU1, "kept", [1.0, 2.0, 3.0])
    weight = torch.nn.Linear(3, 2).to(NPU).weight
    weight.sum().backward()
    for copied in (copy.copy(weight), copy.deepcopy(weight)):
        assert isinstance(copied, torch.nn.Parameter) and copied.device == NPU
        assert copied.grad is None  # as a Parameter copies


def test_set_and_copy_across_devices():
    x = torch.zeros(3, device=NPU)
    x.copy_(torch.arange(3.0, device=NPU1), non_blocking=True)  # copies go anywhere
    assert x.cpu().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(SimulatedDeviceError, match="set_.source_Tensor"):
        x.set_(torch.ones(3))  # set_ does not: real devices refuse another device's storage
    with pytest.raises(SimulatedDeviceError, match="set_.source_Storage_storage_offset"):
        x.set_(torch.ones(3, device=NPU1).untyped_storage(), 0, (3,), (1,))


def test_pinned_memory():
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2)), batch_size=2,
        pin_memory=True,
    )
    (batch,) = next(iter(loader))
    assert batch.is_pinned() and batch[1:].is_pinned() and not torch.ones(2).is_pinned()
    assert batch.to(NPU, non_blocking=True).cpu().tolist() == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(SimulatedDeviceError, match="only CPU tensors can be pinned"):
        torch.ones(2, device=NPU).pin_memory()


def test_torch_save_and_load():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(NPU1)
    model.weight.note = "kept"
    shared = torch.arange(4.0, device=NPU)
    buffer = io.BytesIO()
    torch.save({"state": model.state_dict(), "shared": shared, "view": shared[1:]}, buffer)
    # For the test that loads it where no simulation is installed.
    with open("npu_checkpoint.pt", "wb") as file:
        file.write(buffer.getvalue())
    torch.save(model.weight.detach().cpu(), "expected_weight.pt")
    for where, device in (
        (None, NPU1),
        ("cpu", torch.device("cpu")),
        ("npu", NPU),
        (NPU1, NPU1),
        ({"npu:1": "npu:0", "npu:0": "npu:1"}, NPU),
    ):
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=where)  # weights_only, torch's default
        assert loaded["state"]["weight"].device == device, where
        assert torch.equal(loaded["state"]["weight"].cpu(), model.weight.detach().cpu())
        loaded["shared"].add_(1)  # the storage the two shared when saved, they share again
        assert loaded["view"].cpu().tolist() == [2.0, 3.0, 4.0], where
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    whole = torch.load(buffer, weights_only=False)
    assert isinstance(whole.weight, torch.nn.Parameter) and whole.weight.note == "kept"
    assert whole.weight.device == NPU1 and torch.equal(whole.weight.cpu(), model.weight.cpu())


def test_torch_load_refusals(monkeypatch):
    buffer = io.BytesIO()
    torch.save(torch.ones(2, device=NPU1), buffer)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0")
    buffer.seek(0)
    with pytest.raises(RuntimeError, match="index 1: 1 visible.*map_location"):
        torch.load(buffer)
    legacy = io.BytesIO()
    torch.save(torch.ones(2), legacy, _use_new_zipfile_serialization=False)
    legacy.seek(0)
    with pytest.raises(SimulatedDeviceError, match="legacy.*map_location='cpu'"):
        torch.load(legacy, map_location="npu", weights_only=False)
"""


@needs_simulation
def test_mutators_match_the_cpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_walk=WALK)
    result = runpytest_forked(pytester, *SIM, "-q")
    result.assert_outcomes(passed=26)


@needs_simulation
def test_what_training_code_does(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cases=CASES)
    result = runpytest_forked(pytester, *SIM, "-q")
    result.assert_outcomes(passed=10)
    # Written on the simulated npu, read here, where no simulation is installed: a real npu
    # checkpoint's format, loaded with weights_only and map_location as one.
    loaded = torch.load(pytester.path / "npu_checkpoint.pt", map_location="cpu")
    expected = torch.load(pytester.path / "expected_weight.pt")
    assert type(loaded["state"]["weight"]) is torch.Tensor
    assert torch.equal(loaded["state"]["weight"], expected)
    assert loaded["view"].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="tagged with npu"):
        torch.load(pytester.path / "npu_checkpoint.pt")
