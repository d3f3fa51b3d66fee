"""Sharded gradients in multi-rank tests: a reference on the full tensors, compared on each
rank with that rank's slice of it.

In a rank (``@pytest.mark.gradref_ranks``) the ``grad_reference`` fixture is a
``RankGradReference``: ``grad_reference(fn, *args, shards={"w": 0})`` computes the reference on
the full tensors, as anywhere, and returns a ``ShardedReference``: the full reference, whose
``assert_close`` compares the kernel's local gradients with their slice of it. It is
Reference.assert_close on the sliced reference, so the dtype's tolerances, the golden and its
budget, the aux and the report apply unchanged; a sliced item's label says which slice it is.
A DTensor gradient is compared shard by shard, its local shard against the slice its placement
names, and gathered only with ``gather=True``.

Every rank computes the full reference itself rather than rank 0 broadcasting it: the ranks do
it side by side (the wall time of one reference), nothing large crosses the collective library,
and a broken collective (often what the test is about) cannot corrupt the reference the kernel
is judged against. The ranks draw the same full tensors because they run under the same seed.

Which slice a rank holds follows DTensor's ``Shard(dim)``: ``torch.chunk`` pieces of
ceil(size / ranks), the last ones shorter or empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Union

import torch

from pytest_gradref.reference.differentiation import Result
from pytest_gradref.reference.grad_reference import GradReference
from pytest_gradref.reference.result import Reference, parameter_label

# Which gradients are sharded: an argument by position (as in argnums) or name, or a module's
# parameter by name, mapped to a dimension, None (replicated), or a DTensor placement
# (Shard(dim), Replicate()).
ShardSpec = Mapping[Union[int, str], Any]

_SPEC_HELP = (
    "shards= maps an argument (its position in args, as in argnums, or its name) or a "
    "module's parameter (its name) to the dimension it is sharded along, None (replicated), "
    "or a DTensor placement (Shard(dim), Replicate()), e.g. shards={'weight': 0}"
)


@dataclass(frozen=True)
class Cut:
    """Piece ``index`` of ``count`` along ``dim``, as DTensor's Shard(dim) cuts a tensor."""

    dim: int
    index: int
    count: int

    def bounds(self, size: int) -> tuple[int, int]:
        step = -(-size // self.count)  # torch.chunk's piece size
        start = min(self.index * step, size)
        return start, min(start + step, size)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        start, end = self.bounds(tensor.shape[self.dim])
        return tensor.narrow(self.dim, start, end - start)

    def describe(self, size: int) -> str:
        start, end = self.bounds(size)
        return f"shard {self.index} of {self.count} along dim {self.dim} [{start}:{end}]"


@dataclass(frozen=True)
class Cuts:
    """The cut of each gradient (None: compared whole): by argument, aligned with the
    reference's gradients, and by parameter name."""

    args: tuple[Cut | None, ...] = ()
    params: Mapping[str, Cut] = field(default_factory=dict)

    def arg(self, position: int) -> Cut | None:
        return self.args[position] if position < len(self.args) else None


def _arg_grads(reference: Reference) -> tuple[torch.Tensor, ...]:
    grads = reference.grads
    return grads if isinstance(grads, tuple) else (grads,)


def resolve_shards(spec: ShardSpec, reference: Reference, rank: int, world_size: int) -> Cuts:
    """The cuts a ``shards=`` mapping asks for; a ValueError that names a key or value that
    does not fit the reference."""
    __tracebackhide__ = True
    if not isinstance(spec, Mapping):
        raise TypeError(f"{_SPEC_HELP}; got {spec!r}")
    arguments = reference.grad_arguments
    labels = reference.grad_labels
    grads = _arg_grads(reference)
    args: list[Cut | None] = [None] * len(labels)
    params: dict[str, Cut] = {}
    seen: dict[str, object] = {}
    for key, value in spec.items():
        positions = [
            i
            for i, argument in enumerate(arguments)
            if (isinstance(key, int) and not isinstance(key, bool) and argument.position == key)
            or (isinstance(key, str) and argument.name == key)
        ]
        is_param = isinstance(key, str) and key in reference.param_grads
        if len(positions) + is_param != 1:
            valid = [
                f"{a.position} or {a.name!r}" if a.name else str(a.position) for a in arguments
            ]
            valid += [repr(name) for name in reference.param_grads]
            why = "names two gradients" if positions and is_param else "names no gradient"
            raise ValueError(
                f"shards={{{key!r}: ...}} {why} of this reference; its gradients are "
                f"{', '.join(valid) or 'none'}. {_SPEC_HELP}"
            )
        label = parameter_label(str(key)) if is_param else labels[positions[0]]
        if label in seen:
            raise ValueError(f"shards= names the {label} twice ({seen[label]!r} and {key!r})")
        seen[label] = key
        grad = reference.param_grads[str(key)] if is_param else grads[positions[0]]
        dim = placement_dim(value, f"shards[{key!r}]")
        if dim is None:
            continue
        if not -grad.dim() <= dim < max(grad.dim(), 1):
            raise ValueError(
                f"shards[{key!r}]={dim}: the {label} has {grad.dim()} dimension(s), "
                f"shape {tuple(grad.shape)}, so the dimension must be in "
                f"{-grad.dim()}..{grad.dim() - 1}"
            )
        cut = Cut(dim % grad.dim(), rank, world_size)
        if is_param:
            params[str(key)] = cut
        else:
            args[positions[0]] = cut
    return Cuts(tuple(args), params)


def placement_dim(value: Any, where: str) -> int | None:
    """The dimension a shard spec's value shards along: an int, None (replicated), or a
    DTensor placement (Shard(dim), or Replicate() for None)."""
    __tracebackhide__ = True
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    kind = type(value).__name__
    if kind == "Shard":
        return int(value.dim)
    if kind == "Replicate":
        return None
    if kind == "Partial":
        raise ValueError(
            f"{where} is Partial(): a partial sum on each rank, not a slice of the full "
            "gradient. Reduce it first (dist.all_reduce, or DTensor.redistribute to "
            "Replicate() or Shard(dim)), then compare"
        )
    raise ValueError(f"{where} is {value!r}; {_SPEC_HELP}")


def slice_reference(full: Reference, cuts: Cuts) -> Reference:
    """The reference with each cut gradient (its golden and rounded ones too) sliced, its
    label saying which slice; a parameter's slice is keyed by its name with the slice."""
    __tracebackhide__ = True
    grads = _arg_grads(full)
    arg_cuts = [cuts.arg(i) for i in range(len(grads))]
    labels = tuple(
        label if cut is None else f"{label}, {cut.describe(grad.shape[cut.dim])}"
        for label, grad, cut in zip(full.grad_labels, grads, arg_cuts)
    )

    def args(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(t if cut is None else cut.apply(t) for t, cut in zip(tensors, arg_cuts))

    def params(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            param_key(name, t, cuts.params.get(name)): _cut(t, cuts.params.get(name))
            for name, t in tensors.items()
        }

    sliced = args(grads)
    values = {f.name: getattr(full, f.name) for f in fields(Reference)}
    values.update(
        grads=sliced if isinstance(full.grads, tuple) else sliced[0],
        param_grads=params(full.param_grads),
        grad_labels=labels,
    )
    if full.golden is not None:
        golden = full.golden
        spread = golden.spread
        if spread is not None:  # its runs, computed for the whole reference, sliced alike
            whole = spread.select

            def select(run: Result) -> Result:
                run = whole(run)
                return replace(
                    run, arg_grads=args(run.arg_grads), param_grads=params(run.param_grads)
                )

            spread = replace(spread, select=select)
        values["golden"] = replace(
            golden,
            arg_grads=args(golden.arg_grads),
            param_grads=params(golden.param_grads),
            spread=spread,
        )
    if full.rounded is not None:
        rounded = full.rounded
        values["rounded"] = replace(
            rounded, arg_grads=args(rounded.arg_grads), param_grads=params(rounded.param_grads)
        )
    return Reference(**values)


def _cut(tensor: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    return tensor if cut is None else cut.apply(tensor)


def param_key(name: str, full: torch.Tensor, cut: Cut | None) -> str:
    """A parameter's name, with its slice where it is cut (which labels its item)."""
    return name if cut is None else f"{name}, {cut.describe(full.shape[cut.dim])}"


@dataclass(frozen=True, eq=False)
class ShardedReference(Reference):
    """A reference on the full tensors, in one rank of a multi-rank test: its value and
    gradients are the full ones; ``assert_close`` compares the rank's local gradients with
    their slices (``shards=`` of grad_reference, or a DTensor's placement). ``local`` is the
    reference sliced as ``shards=`` says."""

    cuts: Cuts = field(default_factory=Cuts)
    rank: int = 0
    world_size: int = 1

    @property
    def local(self) -> Reference:
        return slice_reference(self, self.cuts)

    def assert_close(
        self,
        actual_value: torch.Tensor | Sequence[torch.Tensor],
        actual_grads: Any = None,
        *,
        param_grads: Any = None,
        gather: bool = False,
        **options: Any,
    ) -> None:
        """Reference.assert_close (same arguments) on this rank's slices: each gradient named
        in ``shards=`` against its slice of the reference; a DTensor gradient's local shard
        against the slice its placement names, or, with ``gather=True``, the whole gathered
        DTensor against the whole reference. Everything else is compared whole."""
        __tracebackhide__ = True
        arg_cuts = list(self.cuts.args) + [None] * (len(self.grad_labels) - len(self.cuts.args))
        grads = actual_grads
        if actual_grads is not None:
            single = isinstance(actual_grads, torch.Tensor)
            given = [actual_grads] if single else list(actual_grads)
            for i, grad in enumerate(given[: len(arg_cuts)]):
                label = self.grad_labels[i]
                given[i], arg_cuts[i] = _local(grad, arg_cuts[i], label, gather)
            grads = given[0] if single else given
        param_cuts = dict(self.cuts.params)
        actual_params = param_grads
        if param_grads is not None:
            if isinstance(param_grads, torch.nn.Module):
                param_grads = {n: p.grad for n, p in param_grads.named_parameters()}
            actual_params = {}
            for name, grad in dict(param_grads).items():
                label = parameter_label(name)
                local, cut = _local(grad, param_cuts.get(name), label, gather)
                if cut is None:
                    param_cuts.pop(name, None)
                else:
                    param_cuts[name] = cut
                full = self.param_grads.get(name)
                key = name if full is None else param_key(name, full, cut)
                actual_params[key] = local
        cuts = Cuts(tuple(arg_cuts), param_cuts)
        self._check_shapes(grads, cuts)
        slice_reference(self, cuts).assert_close(
            actual_value, grads, param_grads=actual_params, **options
        )

    def _check_shapes(self, grads: Any, cuts: Cuts) -> None:
        """A ValueError where a whole-compared gradient has exactly this rank's shard shape:
        the test most likely left out its shards= entry."""
        __tracebackhide__ = True
        if grads is None:
            return
        given = [grads] if isinstance(grads, torch.Tensor) else list(grads)
        for position, (label, full, actual) in enumerate(
            zip(self.grad_labels, _arg_grads(self), given)
        ):
            if cuts.arg(position) is not None or not isinstance(actual, torch.Tensor):
                continue
            dim = _shard_dim(full.shape, actual.shape, self.rank, self.world_size)
            if dim is not None:
                name = self.grad_arguments[position].name
                key = repr(name) if name else str(self.grad_arguments[position].position)
                raise ValueError(
                    f"assert_close(): the {label} has shape {tuple(actual.shape)} on rank "
                    f"{self.rank}, rank {self.rank}'s shard along dim {dim} of the full "
                    f"{tuple(full.shape)}: if the gradient is sharded, say so with "
                    f"grad_reference(..., shards={{{key}: {dim}}}); if not, the kernel "
                    "returned the wrong shape"
                )


def _shard_dim(
    full: Sequence[int], actual: Sequence[int], rank: int, world_size: int
) -> int | None:
    """The dimension along which ``actual`` is this rank's shard of ``full``, if it is one."""
    if len(full) != len(actual) or tuple(full) == tuple(actual):
        return None
    for dim in range(len(full)):
        start, end = Cut(dim, rank, world_size).bounds(full[dim])
        cut = (*full[:dim], end - start, *full[dim + 1 :])
        if tuple(actual) == cut:
            return dim
    return None


def _local(grad: Any, cut: Cut | None, label: str, gather: bool) -> tuple[Any, Cut | None]:
    """A gradient as this rank compares it, and its cut: a DTensor's local shard and the cut
    of its placement (or, gathered, the whole tensor); anything else as it is."""
    __tracebackhide__ = True
    if not hasattr(grad, "device_mesh") or not hasattr(grad, "to_local"):
        return grad, cut
    if gather:
        return grad.full_tensor(), None
    mesh = grad.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"assert_close(): the {label} is a DTensor on a {mesh.ndim}-D device mesh; shard "
            "by shard compares 1-D meshes: pass gather=True to compare it whole"
        )
    (placement,) = grad.placements
    dim = placement_dim(placement, f"the {label}'s DTensor placement")
    own = None if dim is None else Cut(dim % grad.dim(), mesh.get_local_rank(), mesh.size())
    if cut is not None and (own is None or own.dim != cut.dim):
        raise ValueError(
            f"assert_close(): shards= cuts the {label} along dim {cut.dim}, but its DTensor is "
            f"placed {placement}; drop the shards= entry (the placement says it) or fix it"
        )
    return grad.to_local(), own


@dataclass(frozen=True)
class RankGradReference(GradReference):
    """The ``grad_reference`` fixture in a rank: as anywhere, plus ``shards=``, and it returns
    a ShardedReference."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def for_rank(cls, base: GradReference, rank: int, world_size: int) -> RankGradReference:
        values = {f.name: getattr(base, f.name) for f in fields(GradReference)}
        return cls(**values, rank=rank, world_size=world_size)

    def __call__(
        self, fn: Any, /, *args: Any, shards: ShardSpec | None = None, **options: Any
    ) -> ShardedReference:
        """grad_reference(fn, *args, shards=None, **options): the reference on the full
        tensors; ``shards`` says which gradients each rank holds a slice of (see ShardSpec)."""
        __tracebackhide__ = True
        return self._sharded(super().__call__(fn, *args, **options), shards)

    def kernel(
        self, fn: Any, /, *args: Any, shards: ShardSpec | None = None, **options: Any
    ) -> ShardedReference:
        """grad_reference.kernel(fn, *args, shards=None, **options), likewise."""
        __tracebackhide__ = True
        return self._sharded(super().kernel(fn, *args, **options), shards)

    def _sharded(self, reference: Reference, shards: ShardSpec | None) -> ShardedReference:
        __tracebackhide__ = True
        cuts = resolve_shards(shards or {}, reference, self.rank, self.world_size)
        values = {f.name: getattr(reference, f.name) for f in fields(Reference)}
        return ShardedReference(**values, cuts=cuts, rank=self.rank, world_size=self.world_size)
