"""Sharded gradients in multi-rank tests: a reference on the full tensors, compared on each
rank with that rank's slice of it.

In a rank (``@pytest.mark.gradref_ranks``) the ``grad_reference`` fixture is a
``RankGradReference``: ``grad_reference(fn, *args, shards={"w": 0})`` computes the reference on
the full tensors, as anywhere, and returns a ``ShardedReference``: the full reference, whose
``assert_close`` compares the kernel's local gradients with their slice of it. It is
Reference.assert_close on the sliced reference, so the dtype's tolerances, the golden and its
budget, the aux and the report apply unchanged; a sliced item's label says which slice it is.
A DTensor gradient is compared shard by shard, its local shard against the slice its placements
name, on a device mesh of any dimensions, and gathered only with ``gather=True``. A plain
gradient of a multi-dimensional mesh's layer says its placements the same way:
``shards={"w": (Replicate(), Shard(0))}, mesh=mesh``.

Every rank computes the full reference itself rather than rank 0 broadcasting it: the ranks do
it side by side (the wall time of one reference), nothing large crosses the collective library,
and a broken collective (often what the test is about) cannot corrupt the reference the kernel
is judged against. The ranks draw the same full tensors because they run under the same seed.

Which slice a rank holds follows DTensor's ``Shard(dim)``: ``torch.chunk`` pieces of
ceil(size / ranks), the last ones shorter or empty; on a mesh of several dimensions each
dimension's Shard cuts the piece the earlier ones left, by the rank's coordinate along it.
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
    """Piece ``index`` of ``count`` along ``dim``, as DTensor's Shard(dim) cuts a tensor;
    ``then`` cuts that piece again, as the next dimension of a device mesh does (a DTensor
    placed (Shard(0), Shard(1)) on a 2-D mesh)."""

    dim: int
    index: int
    count: int
    then: Cut | None = None

    def bounds(self, size: int) -> tuple[int, int]:
        """This cut's piece of ``size`` elements (``then`` left aside)."""
        step = -(-size // self.count)  # torch.chunk's piece size
        start = min(self.index * step, size)
        return start, min(start + step, size)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        start, end = self.bounds(tensor.shape[self.dim])
        piece = tensor.narrow(self.dim, start, end - start)
        return piece if self.then is None else self.then.apply(piece)

    def chain(self) -> tuple[Cut, ...]:
        """This cut and those after it, each without its ``then``."""
        rest = () if self.then is None else self.then.chain()
        return (replace(self, then=None), *rest)

    def describe(self, shape: Sequence[int]) -> str:
        """The piece of a tensor of ``shape``, in the whole tensor's indices."""
        starts, sizes = [0] * len(shape), list(shape)
        parts = []
        for cut in self.chain():
            start, end = cut.bounds(sizes[cut.dim])
            begin, size = starts[cut.dim] + start, end - start
            parts.append(
                f"shard {cut.index} of {cut.count} along dim {cut.dim} [{begin}:{begin + size}]"
            )
            starts[cut.dim], sizes[cut.dim] = begin, size
        return " then ".join(parts)


def mesh_cut(
    placements: Sequence[Any], mesh: Any, shape: Sequence[int], label: str, where: str
) -> Cut | None:
    """The cut of this rank's piece of the ``label`` of ``shape`` that ``placements``
    (one per dimension of the device ``mesh``) place: each Shard(dim) cuts the piece the
    mesh's earlier dimensions left, by this rank's coordinate along its own; None where every
    placement replicates."""
    __tracebackhide__ = True
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{where} has {len(placements)} placement(s) for a {mesh.ndim}-D device mesh; give "
            "one per mesh dimension, e.g. (Shard(0), Replicate()) on a 2-D mesh"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{where}: this rank is not in the device mesh {mesh}")
    cuts = []
    for axis, placement in enumerate(placements):
        dim = placement_dim(placement, f"{where}[{axis}]")
        if dim is not None:
            _check_dim(dim, shape, label, f"{where}[{axis}]")
            cuts.append(Cut(dim % len(shape), coordinate[axis], mesh.size(axis)))
    cut = None
    for outer in reversed(cuts):
        cut = replace(outer, then=cut)
    return cut


def _check_dim(dim: int, shape: Sequence[int], label: str, where: str) -> None:
    __tracebackhide__ = True
    ndim = len(shape)
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(
            f"{where}={dim}: the {label} has {ndim} dimension(s), shape {tuple(shape)}, so "
            f"the dimension must be in {-ndim}..{ndim - 1}"
        )


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


def resolve_shards(
    spec: ShardSpec, reference: Reference, rank: int, world_size: int, mesh: Any = None
) -> Cuts:
    """The cuts a ``shards=`` mapping asks for: a dimension or placement cuts the test's ranks
    in order, a placement per dimension of ``mesh`` (a DeviceMesh) cuts by this rank's
    coordinates on it; a ValueError that names a key or value that does not fit the
    reference."""
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
        cut = _spec_cut(value, grad, label, rank, world_size, mesh, f"shards[{key!r}]")
        if cut is None:
            continue
        if is_param:
            params[str(key)] = cut
        else:
            args[positions[0]] = cut
    return Cuts(tuple(args), params)


def _spec_cut(
    value: Any,
    grad: torch.Tensor,
    label: str,
    rank: int,
    world_size: int,
    mesh: Any,
    where: str,
) -> Cut | None:
    """The cut one ``shards=`` value names for a gradient shaped as ``grad``."""
    __tracebackhide__ = True
    if isinstance(value, (tuple, list)):
        if mesh is None:
            raise ValueError(
                f"{where}={value!r} is a placement per device mesh dimension: pass the mesh "
                "too, grad_reference(..., shards=..., mesh=mesh), so this rank's piece is known"
            )
        return mesh_cut(value, mesh, grad.shape, label, where)
    dim = placement_dim(value, where)
    if dim is None:
        return None
    _check_dim(dim, grad.shape, label, where)
    return Cut(dim % grad.dim(), rank, world_size)


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
    if kind == "_StridedShard":
        raise ValueError(
            f"{where} is {value!r}: a strided shard (a dimension sharded by two mesh "
            "dimensions out of order, as FSDP2 over TP does), which is not cut here; compare "
            "the gradient whole with assert_close(..., gather=True)"
        )
    raise ValueError(f"{where} is {value!r}; {_SPEC_HELP}")


def slice_reference(full: Reference, cuts: Cuts) -> Reference:
    """The reference with each cut gradient (its golden and rounded ones too) sliced, its
    label saying which slice; a parameter's slice is keyed by its name with the slice."""
    __tracebackhide__ = True
    grads = _arg_grads(full)
    arg_cuts = [cuts.arg(i) for i in range(len(grads))]
    labels = tuple(
        label if cut is None else f"{label}, {cut.describe(grad.shape)}"
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
    return name if cut is None else f"{name}, {cut.describe(full.shape)}"


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
    placements = tuple(grad.placements)
    own = mesh_cut(placements, grad.device_mesh, grad.shape, label, "its DTensor placements")
    if cut is not None and _pieces(own) != _pieces(cut):
        raise ValueError(
            f"assert_close(): shards= cuts the {label} as {_pieces(cut)} (dimension, piece, "
            f"pieces), but its DTensor is placed {placements}, which cuts it as {_pieces(own)}; "
            "drop the shards= entry (the placements say it) or fix it"
        )
    return grad.to_local(), own


def _pieces(cut: Cut | None) -> list[tuple[int, int, int]]:
    return [] if cut is None else [(c.dim, c.index, c.count) for c in cut.chain()]


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
        self,
        fn: Any,
        /,
        *args: Any,
        shards: ShardSpec | None = None,
        mesh: Any = None,
        **options: Any,
    ) -> ShardedReference:
        """grad_reference(fn, *args, shards=None, mesh=None, **options): the reference on the
        full tensors; ``shards`` says which gradients each rank holds a slice of (see
        ShardSpec), ``mesh`` the DeviceMesh whose dimensions a tuple of placements follows."""
        __tracebackhide__ = True
        return self._sharded(super().__call__(fn, *args, **options), shards, mesh)

    def kernel(
        self,
        fn: Any,
        /,
        *args: Any,
        shards: ShardSpec | None = None,
        mesh: Any = None,
        **options: Any,
    ) -> ShardedReference:
        """grad_reference.kernel(fn, *args, shards=None, mesh=None, **options), likewise."""
        __tracebackhide__ = True
        return self._sharded(super().kernel(fn, *args, **options), shards, mesh)

    def _sharded(
        self, reference: Reference, shards: ShardSpec | None, mesh: Any
    ) -> ShardedReference:
        __tracebackhide__ = True
        cuts = resolve_shards(shards or {}, reference, self.rank, self.world_size, mesh)
        values = {f.name: getattr(reference, f.name) for f in fields(Reference)}
        return ShardedReference(**values, cuts=cuts, rank=self.rank, world_size=self.world_size)
