"""What a test's references were computed from: the seeds torch's generators held, and a
fingerprint of the references' inputs.

Two reports compare where their tests saw the same inputs (diff.py judges by these
fingerprints), whatever seeds the runs were given: a suite that seeds its own tests draws the
same numbers under any ``--gradref-seed``. The seeds say whether the test reseeded torch after
gradref seeded it.

A fingerprint hashes each input's place (argument, keyword, parameter, closure variable),
dtype and shape, each plain value, and at most SAMPLE bytes of each tensor, evenly spaced:
inputs drawn under another seed differ in every element, so a sample tells them apart at a
cost that does not grow with the tensor. Bytes rather than a float sum, so that the same
numbers give the same fingerprint on every device (no reduction order). The samples are copied
on the inputs' devices when the reference is computed (the test may change its tensors
afterwards: one copy per device) and read to the host once per device when the test's record
is made (``fingerprints``), not in between: a passing ``assert_close`` keeps its single host
read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The most bytes of one tensor that a fingerprint reads. Each comes from another place in a
# large tensor, so each costs a cache miss: the bound keeps a fingerprint's cost flat in size.
SAMPLE = 512
# Plain values whose repr is the same in every run (no memory addresses).
_PLAIN = (bool, int, float, complex, str, type(None))


@dataclass(frozen=True)
class SampledInputs:
    """One reference's inputs, sampled but not yet read to the host: each input described
    (place, dtype, shape, or a plain value's repr), and per device the sampled bytes with each
    tensor's (device, start, end) in them, in the inputs' order."""

    description: str
    data: Mapping[torch.device, torch.Tensor]
    spans: tuple[tuple[torch.device, int, int], ...]


def sample_inputs(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> SampledInputs | None:
    """The inputs of ``fn(*args, **kwargs)`` sampled: tensors (nested in lists, tuples and
    dicts too), plain values, a module's parameters and buffers, and the tensors, modules and
    plain values that fn closes over (a lambda's, a functools.partial's). None where a tensor
    cannot be sampled (a tensor subclass, a sparse, quantized or meta tensor): that reference
    has no fingerprint, and the diff falls back to the seeds."""
    import torch

    lines: list[str] = []
    samples: dict[torch.device, list[torch.Tensor]] = {}
    ends: dict[torch.device, int] = {}
    spans: list[tuple[torch.device, int, int]] = []
    for place, value in _inputs(fn, args, kwargs):
        if not isinstance(value, torch.Tensor):
            lines.append(f"{place}={value!r}")
            continue
        sample = _sample(value)
        if sample is None:
            return None
        lines.append(f"{place}:{str(value.dtype).removeprefix('torch.')}{list(value.shape)}")
        device = value.device
        samples.setdefault(device, []).append(sample)
        start = ends.get(device, 0)
        ends[device] = start + sample.numel()
        spans.append((device, start, ends[device]))
    # One copy per device: the values as they are now, whatever the test does to its tensors
    # later.
    data = {device: torch.cat(parts) for device, parts in samples.items()}
    return SampledInputs("\n".join(lines), data, tuple(spans))


def _inputs(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, Any]]:
    """(place, value) for every tensor and plain value a reference is computed from."""
    import functools

    for i, arg in enumerate(args):
        yield from _values(f"args[{i}]", arg)
    for name, value in kwargs.items():
        yield from _values(f"kwargs[{name!r}]", value)
    yield from _values("fn", fn)
    owner = getattr(fn, "__self__", None)  # a bound method's module
    if owner is not None:
        yield from _values("fn.__self__", owner)
    while isinstance(fn, functools.partial):
        yield from _values("partial.args", fn.args)
        yield from _values("partial.kwargs", fn.keywords)
        fn = fn.func
    for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        yield from _values(f"closure[{i}]", contents)


def _values(place: str, value: Any) -> Iterator[tuple[str, Any]]:
    """The tensors and plain values in ``value`` (nested in lists, tuples and dicts too) as
    they are, a module's parameters and buffers by name; any other object (whose repr may
    hold an address) left out."""
    import torch
    from torch.utils._pytree import tree_leaves

    # A tensor, the common argument, without pytree's walk.
    leaves = [value] if isinstance(value, torch.Tensor) else tree_leaves(value)
    for j, leaf in enumerate(leaves):
        where = f"{place}[{j}]"
        if isinstance(leaf, (torch.Tensor, *_PLAIN)):
            yield where, leaf
        elif isinstance(leaf, torch.nn.Module):
            yield from ((f"{where}.{n}", p) for n, p in leaf.named_parameters())
            yield from ((f"{where}.{n}", b) for n, b in leaf.named_buffers())


def _sample(tensor: torch.Tensor) -> torch.Tensor | None:
    """At most SAMPLE bytes of a plain strided tensor, evenly spaced, as a 1-D uint8 view (of
    a contiguous tensor; of a small copy of another); None for a tensor whose bytes cannot be
    read this way."""
    import torch

    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
    if not plain or tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
        return None
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        # Another layout (a transposed weight, an expanded tensor): every dimension sampled
        # evenly, a view whose few elements reshape copies.
        per_dim = max(2, math.ceil((SAMPLE / tensor.element_size()) ** (1 / tensor.dim())))
        steps = tuple(slice(None, None, max(1, -(-size // per_dim))) for size in tensor.shape)
        tensor = tensor[steps].reshape(-1)
    try:
        data = tensor.view(-1).view(torch.uint8)
    except RuntimeError:  # a conjugate or negative view, say
        return None
    step = max(1, -(-data.numel() // SAMPLE))
    if step % 2 == 0:
        # An odd step reads every byte position of the elements in turn (element sizes are
        # powers of two): an even one would skip some, such as a float's exponent.
        step += 1
    return data[::step]


def fingerprints(sampled: Sequence[SampledInputs | None]) -> list[str | None]:
    """Each reference's fingerprint (16 hex digits; None where it has none), reading the
    samples to the host once per device."""
    import ctypes
    import hashlib

    import torch

    # Per device: which reference each block of samples belongs to, and the blocks.
    on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for index, inputs in enumerate(sampled):
        for device, block in (inputs.data if inputs is not None else {}).items():
            on_device.setdefault(device, []).append((index, block))
    host: dict[tuple[int, torch.device], bytes] = {}
    for device, blocks in on_device.items():
        whole = torch.cat([block for _, block in blocks]) if len(blocks) > 1 else blocks[0][1]
        whole = whole.cpu()  # the host read
        read = ctypes.string_at(whole.data_ptr(), whole.numel())
        offset = 0
        for index, block in blocks:
            host[index, device] = read[offset : offset + block.numel()]
            offset += block.numel()
    found: list[str | None] = []
    for index, inputs in enumerate(sampled):
        if inputs is None:
            found.append(None)
            continue
        digest = hashlib.blake2b(inputs.description.encode(), digest_size=8)
        for device, start, end in inputs.spans:
            digest.update(host[index, device][start:end])
        found.append(digest.hexdigest())
    return found


def generator_seeds(device_type: str) -> tuple[int, ...]:
    """The seeds torch's generators were last given: the CPU's, and the device family's where
    it has started (asking an unstarted one would start it)."""
    import torch

    seeds = [torch.initial_seed()]
    module = getattr(torch, device_type, None) if device_type != "cpu" else None
    initial_seed = getattr(module, "initial_seed", None)
    started = getattr(module, "is_initialized", None)
    if initial_seed is not None and (started is None or started()):
        seeds.append(int(initial_seed()))
    return tuple(seeds)
