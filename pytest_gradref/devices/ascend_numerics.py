"""What the simulated npu models of Ascend numerics (``--gradref-simulate-numerics=ascend``).

Only what Huawei documents for torch_npu's eager operators is modelled; each rule names its
source. Everything else stays torch's CPU kernel, and the docs page
(docs/xdist-and-simulation.md) lists what is not modelled and why.

HF32 for float32 matmul-class and convolution operators:

- ``torch_npu.npu.matmul.allow_hf32`` turns HF32 on for "matmul-class operators", default
  False; "its function and usage are like torch.backends.cuda.matmul.allow_tf32"
  (https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000221.html,
  .../Pytorch/60RC3/apiref/apilist/ptaoplist_000848.html).
- ``torch_npu.npu.conv.allow_hf32`` does so for "conv-class operators", default True, like
  torch.backends.cudnn.allow_tf32
  (https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000923.html).
- HF32 "shares the same value range with float32, but its mantissa precision (11 bits) is
  close to FP16 (10 bits)"; it replaces float32 only where the operator's inputs or outputs
  are float32 (CANN ATC ``--allow_hf32``,
  https://www.hiascend.com/document/detail/en/CANNCommunityEdition/910/devaids/atctool/atlasatcparam_16_0067.html).
- "FP32 data in L0A/L0B is rounded off to HF32 before participating in the Mmad computation"
  (Ascend C ``SetHF32Mode``,
  https://www.hiascend.com/document/detail/en/canncommercial/850/API/ascendcopapi/atlasascendc_api_07_0258.html):
  the two multiplied operands are rounded, a bias added to the product is not.
- The rounding: ``SetHF32(enableHF32, transMode=0)``, "0: rounding to the nearest even number
  when the distance is equal" is the default; 1 rounds ties away from zero
  (https://www.hiascend.com/document/detail/en/canncommercial/850/API/ascendcopapi/atlasascendc_api_07_0646.html).
  Which mode torch_npu's aclnn operators pass is not documented; the default, ties to even,
  is modelled.

Which eager operators honour the flags is not listed in any document (ATC points to an ini
file inside the CANN installation). torch_npu's operator sources pass the matmul flag to mm,
bmm, addmm, baddbmm, addbmm, mv, addmv, matmul and linear, and the conv flag to convolution
and its backward (Ascend/op-plugin, ``op_plugin/utils/OpUtils.cpp``
``get_cube_math_type_with_passthrough`` and its callers in ``op_plugin/ops/opapi``): that is
the list below. dot, vdot and addr do not take the flag there, so they are left in float32.

The modelled product is an Atlas A2 / A3 training product: its torch_npu default precision
mode is ``must_keep_origin_dtype`` (float32 stays float32 unless HF32 is allowed), where the
first Atlas training products default to ``allow_fp32_to_fp16``, float16 for matrix
operators (torch_npu training migration guide, ACL_PRECISION_MODE,
https://www.hiascend.com/doc_center/source/zh/Pytorch/700/ptmoddevg/trainingmigrguide/PT_LMTMOG_0076.html),
which is not modelled.

Imported by the simulation only: it imports torch.
"""

from __future__ import annotations

from typing import Any

import torch

# The --gradref-simulate-numerics values: the CPU's kernels as they are, or the documented
# Ascend behaviour on top of them.
NUMERICS = ("cpu", "ascend")

# Float32 keeps 23 explicit mantissa bits, HF32 11: rounding clears the low 12.
_DROPPED_BITS = 23 - 11
_HALF_ULP = (1 << (_DROPPED_BITS - 1)) - 1  # 0x7FF: below half, plus the kept lsb for ties
_KEEP_MASK = -(1 << _DROPPED_BITS)  # ~0xFFF as a signed int32


def round_to_hf32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (float32) rounded to HF32: 11 explicit mantissa bits, float32's exponent
    range, round to nearest with ties to even (``SetHF32``'s default ``transMode=0``).

    A value beyond the largest HF32 rounds to infinity, as IEEE rounding does (the docs say
    only that the range is float32's); NaN stays NaN and infinities stay infinite."""
    bits = tensor.view(torch.int32)
    kept_lsb = (bits >> _DROPPED_BITS) & 1
    # Adding to the bit pattern rounds the magnitude, whatever the sign.
    rounded = ((bits + (_HALF_ULP + kept_lsb)) & _KEEP_MASK).view(torch.float32)
    return torch.where(torch.isnan(tensor), tensor, rounded)


class Hf32Flag:
    """One ``allow_hf32`` switch of the stand-in: ``torch.npu.matmul`` or ``torch.npu.conv``."""

    def __init__(self, name: str, default: bool) -> None:
        self._name = name
        self._value = default

    @property
    def allow_hf32(self) -> bool:
        return self._value

    @allow_hf32.setter
    def allow_hf32(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"torch_npu.npu.{self._name}.allow_hf32 takes True or False, "
                f"got {value!r} ({type(value).__name__})"
            )
        self._value = value

    def __repr__(self) -> str:
        return f"<torch_npu.npu.{self._name} (simulated): allow_hf32={self._value}>"


# The documented defaults: matmul False, conv True (the pages cited above).
MATMUL = Hf32Flag("matmul", default=False)
CONV = Hf32Flag("conv", default=True)

# Per operator (aten name): the flag that governs it and the arguments the cube multiplies,
# the ones rounded to HF32. A bias (addmm's self, convolution's bias) is not rounded.
_ROUNDED: dict[str, tuple[Hf32Flag, tuple[str, ...]]] = {
    "aten::mm": (MATMUL, ("self", "mat2")),
    "aten::bmm": (MATMUL, ("self", "mat2")),
    "aten::addmm": (MATMUL, ("mat1", "mat2")),
    "aten::baddbmm": (MATMUL, ("batch1", "batch2")),
    "aten::addbmm": (MATMUL, ("batch1", "batch2")),
    "aten::mv": (MATMUL, ("self", "vec")),
    "aten::addmv": (MATMUL, ("mat", "vec")),
    # matmul, linear and einsum are composite: a tensor subclass sees the operators above.
    "aten::convolution": (CONV, ("input", "weight")),
    "aten::convolution_backward": (CONV, ("grad_output", "input", "weight")),
}
# Per operator overload: its flag and the positions of its rounded arguments (None: not one
# of them), filled on first sight, so each operator costs one dictionary lookup after that.
_positions: dict[Any, tuple[Hf32Flag, tuple[tuple[int, str], ...]] | None] = {}


def _rounded_arguments(func: Any) -> tuple[Hf32Flag, tuple[tuple[int, str], ...]] | None:
    if func in _positions:
        return _positions[func]
    schema = func._schema
    entry = _ROUNDED.get(schema.name)
    found = None
    if entry is not None:
        flag, names = entry
        found = (
            flag,
            tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.name in names),
        )
    _positions[func] = found
    return found


def _hf32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return round_to_hf32(value)
    return value


def apply(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``func``'s CPU arguments as an Ascend A2 would compute with them: the multiplied
    float32 operands of a matmul-class or convolution operator rounded to HF32 while its
    flag is on, everything else as given. Returns ``(args, kwargs)``."""
    rounded = _rounded_arguments(func)
    if rounded is None:
        return args, kwargs
    flag, positions = rounded
    if not flag.allow_hf32:
        return args, kwargs
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for position, name in positions:
        if position < len(new_args):
            new_args[position] = _hf32(new_args[position])
        elif name in new_kwargs:
            new_kwargs[name] = _hf32(new_kwargs[name])
    return tuple(new_args), new_kwargs
