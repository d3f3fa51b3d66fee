"""Triton kernels of the fused-linear JSD loss: the row kernel of one chunk, and the backward's
scaled cast of the float32 weight-gradient sum.

The row kernel has the per-chunk contract of ``_chunk_torch.jsd_chunk_``. One program owns one
row and streams the vocabulary in ``BLOCK_V`` tiles; all math is fp32 in base 2 (``exp2`` is
one hardware instruction, ``exp`` is that plus a multiply), converted to natural-log units
only at the end.

Passes over a row (Vs == Vt == V, fp32; bytes per row in brackets):

* pass 1 [read 8V]: online log-sum-exp of the scaled student (zero-padded to Vt), of the
  scaled teacher and, when the hard loss needs it, of the unscaled student; for beta == 1 the
  gradient's row constant KL(S||T), an expectation under S, in the same pass.
* pass 2 [read 8V], 0 < beta < 1 only: the soft loss and K = sum(S L), L = log(M / S), from
  d = log T - log S per element (see ``_chunk_torch``: terms small where S ~ T, none a
  difference of large ones); both need the two final log-sum-exps, so they cannot join pass 1.
* last pass [read 8V, write 4V]: the gradient (in the fused loss, over the teacher logits
  each tile has just read) and, for beta == 0 and beta == 1, the soft loss.

Where d is small, L comes from a short series in d (fused multiply-adds, no extra
transcendental per element), so the passes stay bound by memory traffic.

So 28V bytes per row for 0 < beta < 1 and 20V for beta in {0, 1} (fp32 teacher; a bf16
teacher takes 2V per read and per write off); each pass runs in the opposite direction of the
one before, so its first tiles may still be in L2. Ignored rows only write zeros. Per-row
losses go to an (n,) buffer summed by torch: deterministic, no atomics, no host
synchronisation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._options import LossOptions

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as exc:  # reported by triton_unavailable_reason; the torch path still works
    triton = None
    _TRITON_IMPORT_ERROR: str | None = f"triton is not importable ({exc})"
else:
    _TRITON_IMPORT_ERROR = None

__all__ = ["jsd_chunk_", "scaled_cast", "triton_unavailable_reason"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Largest tile once the rows fill the GPU: wider tiles do not pay there (_default_config).
_MAX_BLOCK_V = 2048
# Elements per program of the scaled cast, a memory-bound copy whose time does not depend on
# the block between 1024 and 8192 (benchmarks/results/h200/design-notes.md).
_CAST_BLOCK = 4096

# The soft loss's specialisations, the row kernel's SOFT_LOSS: the two KL endpoints need one
# pass less than the general JSD.
_KL_TEACHER_STUDENT = 0  # beta == 0: KL(T||S)
_KL_STUDENT_TEACHER = 1  # beta == 1: KL(S||T)
_JSD_MIXTURE = 2  # 0 < beta < 1


if triton is not None:
    _LOG2E_K = tl.constexpr(_LOG2E)
    _LN2_K = tl.constexpr(_LN2)
    # A kernel reads module globals only as constexprs.
    _KL_TEACHER_STUDENT_K = tl.constexpr(_KL_TEACHER_STUDENT)
    _KL_STUDENT_TEACHER_K = tl.constexpr(_KL_STUDENT_TEACHER)
    _JSD_MIXTURE_K = tl.constexpr(_JSD_MIXTURE)
    # Stands in for -inf in pass 1: below every real logit, yet _NEG - _NEG is 0, not NaN.
    _NEG = tl.constexpr(-3.0e38)
    # |log2(T / S)| below which L comes from its series: |log(T / S)| < 0.25.
    _SERIES_RADIUS2 = tl.constexpr(0.25 / _LN2)

    # The device functions of triton.language that the row kernel calls, named here so that
    # the interpreter can call them as plain functions, like this module's helpers (below).
    # (tl.zeros is one too: the kernel calls tl.full, the builtin it wraps.)
    _tl_max = tl.max
    _tl_sum = tl.sum

    @triton.jit
    def _log2_fast(x, FAST_LOG2: tl.constexpr):
        # The hardware lg2.approx is within 2e-7 of log2 on [1, 2) and one instruction instead
        # of libdevice's ~30; callers use it where that absolute error is small next to the
        # result.
        if FAST_LOG2:
            return libdevice.fast_log2f(x)
        return tl.log2(x)

    @triton.jit
    def _logaddexp2(a, b, FAST_LOG2: tl.constexpr):
        # Safe when one side is -inf (a teacher probability of exactly zero).
        hi = tl.maximum(a, b)
        return hi + _log2_fast(1.0 + tl.exp2(tl.minimum(a, b) - hi), FAST_LOG2)

    @triton.jit
    def _series_argument(x, INTERPRETED: tl.constexpr):
        # A series is selected only where |x| < _SERIES_RADIUS2; elsewhere its value is
        # dropped. Compiled, an overflow there costs nothing; the CPU interpreter (numpy)
        # warns about it, so it gets the argument clamped.
        if INTERPRETED:
            return tl.minimum(tl.maximum(x, -_SERIES_RADIUS2), _SERIES_RADIUS2)
        return x

    @triton.jit
    def _log_mixture_ratio(
        d2, c1, c2, c3, c4, c5, c6, c7, log2_beta, log2_1mbeta, FAST_LOG2: tl.constexpr, INTERPRETED
    ):
        """L = log(M / S) = log(1 - beta + beta 2**d2) in natural units, d2 = log2(T / S), to
        a few ulps of L also where d2 is small (log M - log S there would keep only the
        absolute accuracy of log M). Where |d2 ln 2| < 0.25: the series c1..c7 of
        :func:`_mixture_series` (truncation below 5e-9 of L); elsewhere the log-sum-exp of the
        mixture."""
        x = _series_argument(d2, INTERPRETED)
        series = x * (c1 + x * (c2 + x * (c3 + x * (c4 + x * (c5 + x * (c6 + x * c7))))))
        mixture = _logaddexp2(log2_1mbeta, log2_beta + d2, FAST_LOG2) * _LN2_K
        return tl.where(tl.abs(d2) < _SERIES_RADIUS2, series, mixture)

    @triton.jit
    def _rounded_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """float32 ``x`` as ``dtype``, rounded to nearest even. Compiled, that is the cast
        (cvt.rn); Triton's CPU interpreter truncates a cast to bfloat16, so there the rounding
        is done on the bits. (NaN stays NaN; a carry into the exponent gives inf.)"""
        if INTERPRETED and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _online_lse2(m, d, x):
        """One tile of an online base-2 log-sum-exp: running max m (scalar), per-lane sums d.

        Returns the new max, the rescaled sums, the factor old sums were rescaled by and the
        tile's 2**(x - m_new), so callers can rescale their own weighted sums alike.
        """
        m_new = tl.maximum(m, _tl_max(x, 0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(x - m_new)
        return m_new, d * alpha + p, alpha, p

    @triton.jit
    def _jsd_chunk_kernel(
        z_ptr,
        t_ptr,
        label_ptr,
        out_ptr,
        soft_ptr,
        hard_ptr,
        vs,
        vt,
        stride_z,
        stride_t,
        stride_out,
        ignore_index,
        scale2,  # log2(e) / temperature
        beta,
        log2_beta,
        log2_1mbeta,
        c1,  # c1..c7: the series of _log_mixture_ratio
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
        soft_coef,  # d(soft)/dz factor
        weight_hard,
        SOFT_LOSS: tl.constexpr,  # _KL_TEACHER_STUDENT_K, _KL_STUDENT_TEACHER_K or _JSD_MIXTURE_K
        HARD: tl.constexpr,
        SHARE_LSE: tl.constexpr,  # softmax(z) == S (tau == 1, Vt == Vs)
        FAST_LOG2: tl.constexpr,  # compiled for NVIDIA; the CPU interpreter lacks libdevice
        INTERPRETED: tl.constexpr,  # Triton's CPU interpreter: _series_argument, _rounded_to
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_z
        t_row = t_ptr + row * stride_t
        out_row = out_ptr + row * stride_out
        offs = tl.arange(0, BLOCK_V)
        label = tl.load(label_ptr + row)

        if label == ignore_index:
            zero = tl.full([BLOCK_V], 0, tl.float32)
            for start in range(0, vs, BLOCK_V):
                cols = start + offs
                tl.store(out_row + cols, zero.to(out_ptr.dtype.element_ty), mask=cols < vs)
            tl.store(soft_ptr + row, 0.0)
            if HARD:
                tl.store(hard_ptr + row, 0.0)
        else:
            m_s = _NEG
            m_t = _NEG
            m_z = _NEG
            d_s = tl.full([BLOCK_V], 0, tl.float32)
            d_t = tl.full([BLOCK_V], 0, tl.float32)
            d_z = tl.full([BLOCK_V], 0, tl.float32)
            e = tl.full([BLOCK_V], 0, tl.float32)  # beta 1: E_S[s - t] terms
            z_label = 0.0
            if HARD:
                # An out-of-range label reads nothing and turns the hard loss into NaN.
                z_label = tl.load(
                    z_row + label, mask=(label >= 0) & (label < vs), other=float("nan")
                )

            # Pass 1: log-sum-exps (and, for beta = 1, the gradient's row constant).
            for start in range(0, vt, BLOCK_V):
                cols = start + offs
                in_t = cols < vt
                z = tl.load(z_row + cols, mask=cols < vs, other=0.0)
                t = tl.load(t_row + cols, mask=in_t, other=0.0).to(tl.float32)
                # Columns in [vs, vt) keep the student's zero padding; columns past vt drop out.
                xs = tl.where(in_t, z * scale2, _NEG)
                xt = tl.where(in_t, t * scale2, _NEG)
                m_s, d_s, alpha_s, p_s = _online_lse2(m_s, d_s, xs)
                m_t, d_t, _, _ = _online_lse2(m_t, d_t, xt)
                # Zero-weight terms are masked out before the product, so no 0 * inf.
                if SOFT_LOSS == _KL_STUDENT_TEACHER_K:
                    e = e * alpha_s + p_s * tl.where(p_s > 0, xs - xt, 0.0)
                if HARD and not SHARE_LSE:
                    xz = tl.where(cols < vs, z * _LOG2E_K, _NEG)
                    m_z, d_z, _, _ = _online_lse2(m_z, d_z, xz)

            sum_s = _tl_sum(d_s, 0)
            sum_t = _tl_sum(d_t, 0)
            lse_s = m_s + tl.log2(sum_s)
            lse_t = m_t + tl.log2(sum_t)
            lse_z = lse_s
            if HARD and not SHARE_LSE:
                lse_z = m_z + tl.log2(_tl_sum(d_z, 0))

            # The gradient's row constant, in natural units: KL(S||T) for beta = 1 (from pass
            # 1), K = sum(S L) for the mixture (pass 2).
            k = 0.0
            if SOFT_LOSS == _KL_STUDENT_TEACHER_K:
                k = (_tl_sum(e, 0) / sum_s - lse_s + lse_t) * _LN2_K
            if SOFT_LOSS == _JSD_MIXTURE_K:
                # Pass 2: the loss, beta sum(T (d - L)) - (1 - beta) sum(S L) with
                # d = log T - log S and L = log(M / S) (= beta sum(T d) - sum(M L), see
                # _chunk_torch): every term is small where S ~ T, none a difference of large
                # ones; and K = sum(S L). Needs both final log-sum-exps.
                acc_t = tl.full([BLOCK_V], 0, tl.float32)
                acc_s = tl.full([BLOCK_V], 0, tl.float32)
                # Backwards, so the first tiles re-read are the ones pass 1 read last and the
                # L2 cache may still hold; the last pass then runs forwards for the same reason.
                last_t = (vt - 1) // BLOCK_V * BLOCK_V
                for i in range(0, vt, BLOCK_V):
                    cols = last_t - i + offs
                    in_t = cols < vt
                    z = tl.load(z_row + cols, mask=cols < vs, other=0.0)
                    t = tl.load(t_row + cols, mask=in_t, other=0.0).to(tl.float32)
                    ls = z * scale2 - lse_s
                    lt = t * scale2 - lse_t
                    # A zero teacher probability (lt = -inf) adds T log(T / M) = 0 * finite.
                    d2 = tl.maximum(lt - ls, _NEG)
                    el = _log_mixture_ratio(
                        d2,
                        c1,
                        c2,
                        c3,
                        c4,
                        c5,
                        c6,
                        c7,
                        log2_beta,
                        log2_1mbeta,
                        FAST_LOG2,
                        INTERPRETED,
                    )
                    acc_t += tl.where(in_t, tl.exp2(lt) * (d2 * _LN2_K - el), 0.0)
                    acc_s += tl.where(in_t, tl.exp2(ls) * el, 0.0)
                k = _tl_sum(acc_s, 0)
                tl.store(soft_ptr + row, beta * _tl_sum(acc_t, 0) - (1.0 - beta) * k)
            if HARD:
                tl.store(hard_ptr + row, lse_z * _LN2_K - z_label)

            # Last pass: the gradient (the student's padding columns have none) and, for the
            # KL endpoints, the loss: KL(T||S) = sum(T d + S - T), KL(S||T) = sum(-S d - S + T),
            # small terms where S ~ T (the lse_t - lse_s of pass 1 would carry their rounding).
            # Each tile is written after it is read, so the output may be the teacher logits.
            acc = tl.full([BLOCK_V], 0, tl.float32)
            width = vs if SOFT_LOSS == _JSD_MIXTURE_K else vt
            last = (width - 1) // BLOCK_V * BLOCK_V
            for i in range(0, width, BLOCK_V):
                cols = (i if SOFT_LOSS == _JSD_MIXTURE_K else last - i) + offs
                in_s = cols < vs
                in_t = cols < vt
                z = tl.load(z_row + cols, mask=in_s, other=0.0)
                t = tl.load(t_row + cols, mask=in_t, other=0.0).to(tl.float32)
                ls = z * scale2 - lse_s
                lt = t * scale2 - lse_t
                s = tl.exp2(ls)
                # acc: the KL endpoints' terms in base-2 units (converted once, after the sum).
                if SOFT_LOSS == _KL_TEACHER_STUDENT_K:
                    q = tl.exp2(lt)
                    s_minus_q = s - q
                    g = soft_coef * s_minus_q
                    # A zero teacher probability (lt = -inf) adds 0 * finite, not 0 * inf.
                    t_d2 = q * tl.maximum(lt - ls, _NEG)
                    acc += tl.where(in_t, t_d2 + s_minus_q * _LOG2E_K, 0.0)
                elif SOFT_LOSS == _KL_STUDENT_TEACHER_K:
                    q = tl.exp2(lt)
                    g = soft_coef * s * ((ls - lt) * _LN2_K - k)
                    # There an S above 0 makes the KL infinite, as it is.
                    s_d2 = s * tl.where(s > 0, ls - lt, 0.0)
                    acc += tl.where(in_t, s_d2 + (q - s) * _LOG2E_K, 0.0)
                else:
                    # L = log(M / S) again, from log M as a log-sum-exp: to about 2e-7 absolute,
                    # far below the rounding of the gradient to the matmul dtype, at a third of
                    # the work of pass 2's form (this pass also writes).
                    lm = _logaddexp2(ls + log2_1mbeta, lt + log2_beta, FAST_LOG2)
                    g = soft_coef * s * (k - (lm - ls) * _LN2_K)
                if HARD:
                    p = s if SHARE_LSE else tl.exp2(z * _LOG2E_K - lse_z)
                    g += weight_hard * (p - tl.where(cols == label, 1.0, 0.0))
                rounded = _rounded_to(g, out_ptr.dtype.element_ty, INTERPRETED)
                tl.store(out_row + cols, rounded, mask=in_s)
            if SOFT_LOSS != _JSD_MIXTURE_K:
                tl.store(soft_ptr + row, _tl_sum(acc, 0) * _LN2_K)

    @triton.jit
    def _scaled_cast_kernel(
        src_ptr, scale_ptr, dst_ptr, numel, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < numel
        scale = tl.load(scale_ptr).to(tl.float32)
        values = tl.load(src_ptr + offs, mask=in_range)
        scaled = _rounded_to(values * scale, dst_ptr.dtype.element_ty, INTERPRETED)
        tl.store(dst_ptr + offs, scaled, mask=in_range)

    if not isinstance(_jsd_chunk_kernel, triton.JITFunction):
        # Triton's CPU interpreter (TRITON_INTERPRET=1) patches triton.language anew on every
        # call of a @triton.jit device function (the row kernel makes several per tile), though
        # a kernel's grid runs with it patched throughout (the cost: CHANGELOG.md).
        # There this module's helpers, tl.max and tl.sum are their plain Python functions,
        # called as Python calls. The interpreter's rewriting of a device function
        # (assignments made tensors, chained comparisons split) would change nothing in them:
        # they assign only tensors and chain no comparison.
        _log2_fast = getattr(_log2_fast, "fn", _log2_fast)
        _logaddexp2 = getattr(_logaddexp2, "fn", _logaddexp2)
        _series_argument = getattr(_series_argument, "fn", _series_argument)
        _log_mixture_ratio = getattr(_log_mixture_ratio, "fn", _log_mixture_ratio)
        _rounded_to = getattr(_rounded_to, "fn", _rounded_to)
        _online_lse2 = getattr(_online_lse2, "fn", _online_lse2)
        _tl_max = getattr(_tl_max, "fn", _tl_max)
        _tl_sum = getattr(_tl_sum, "fn", _tl_sum)
        # Their bodies call builtins of triton.language.core, which the interpreter patches for
        # a kernel only where that module is among the globals of the kernel's module (Triton
        # 3.2 and 3.4 need this; 3.9 patches its reduction anyway).
        _tl_core = tl.core


def _compiled() -> bool:
    """False when TRITON_INTERPRET=1 was set as the kernels were defined."""
    return isinstance(_jsd_chunk_kernel, triton.JITFunction)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when ``jsd_chunk_`` can run on tensors on ``device``, else why it cannot."""
    if _TRITON_IMPORT_ERROR is not None:
        return _TRITON_IMPORT_ERROR
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if not _compiled():
            return None
        return (
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "gradref_kernels._chunk_triton is imported"
        )
    return (
        f"the Triton chunk kernel runs on cuda (or cpu under TRITON_INTERPRET=1), not {device.type}"
    )


def _mixture_series(beta: float, terms: int = 7) -> list[float]:
    """Coefficients c_n of log(1 - beta + beta 2^d2) = sum c_n d2^n, n = 1..terms.

    In d = d2 ln 2 the function is the log-MGF of a Bernoulli(beta) variable, so its
    coefficients are the cumulants kappa_n over n!, from the moments (all beta) by the
    moment-cumulant recursion; the series converges for |d| < pi, and seven terms leave a
    truncation below 5e-9 of the result for |d| < 0.25."""
    kappa = [0.0] * (terms + 1)
    for n in range(1, terms + 1):
        kappa[n] = beta - sum(math.comb(n - 1, j - 1) * kappa[j] * beta for j in range(1, n))
    return [kappa[n] / math.factorial(n) * _LN2**n for n in range(1, terms + 1)]


def _soft_loss(beta: float) -> int:
    """The kernel's soft-loss specialisation for ``beta``."""
    if beta == 0.0:
        return _KL_TEACHER_STUDENT
    if beta == 1.0:
        return _KL_STUDENT_TEACHER
    return _JSD_MIXTURE


def _default_config(n: int, vt: int, soft_loss: int, shared_softmax: bool) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for n rows of vt columns of the ``soft_loss`` specialisation
    (:func:`_soft_loss`); ``shared_softmax`` when the hard loss's softmax is S itself
    (temperature 1, one vocabulary).

    Chosen by ``python benchmarks/tune_chunk.py triton``; the timings, and the layouts tried
    and left out, are in ``benchmarks/results/h200/design-notes.md``.

    - the mixture's three passes: 2048 x 8 warps from 512 rows up;
    - the two-pass KL endpoints: 1024 x 4, except with the shared softmax from 2048 rows,
      where 2048 x 8 wins. Registers and spills do not explain the difference: the compiler
      schedules each specialisation differently, so each is tuned on its own;
    - fewer rows leave SMs idle and prefer wider tiles.
    """
    width = triton.next_power_of_2(vt)
    if n < 512:
        return min(2 * _MAX_BLOCK_V, width), 8 if soft_loss == _JSD_MIXTURE else 16
    if soft_loss == _JSD_MIXTURE or (shared_softmax and n >= 2048):
        return min(_MAX_BLOCK_V, width), 8
    return min(_MAX_BLOCK_V // 2, width), 4


def _launch(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    grad_out: Tensor,
    options: LossOptions,
    block_v: int,
    num_warps: int,
) -> tuple[Tensor, Tensor]:
    """``jsd_chunk_`` with an explicit launch configuration (for tests and tuning)."""
    beta, temperature, ignore_index = options.beta, options.temperature, options.ignore_index
    weight_hard, weight_soft = options.weight_hard, options.weight_soft
    compute_hard = options.compute_hard
    n, vs = student_logits.shape
    vt = teacher_logits.shape[1]
    _check(student_logits, teacher_logits, labels, grad_out, beta, temperature)
    soft_rows = torch.empty(n, dtype=torch.float32, device=student_logits.device)
    hard_rows = torch.empty_like(soft_rows) if compute_hard else soft_rows
    if n > 0:
        soft_loss = _soft_loss(beta)
        # d(soft)/dz factor (the kernel's logs are in natural units there).
        soft_coef = weight_soft / temperature
        if soft_loss == _JSD_MIXTURE:
            soft_coef *= 1.0 - beta
        _jsd_chunk_kernel[(n,)](
            student_logits,
            teacher_logits,
            labels,
            grad_out,
            soft_rows,
            hard_rows,
            vs,
            vt,
            student_logits.stride(0),
            teacher_logits.stride(0),
            grad_out.stride(0),
            ignore_index,
            _LOG2E / temperature,
            beta,
            math.log2(beta) if beta > 0.0 else 0.0,
            math.log2(1.0 - beta) if beta < 1.0 else 0.0,
            *_mixture_series(beta),
            soft_coef,
            weight_hard,
            SOFT_LOSS=soft_loss,
            HARD=compute_hard,
            SHARE_LSE=options.shares_softmax(vs, vt),
            FAST_LOG2=_compiled() and torch.version.hip is None,
            INTERPRETED=not _compiled(),
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    soft = soft_rows.sum()
    hard = hard_rows.sum() if compute_hard else torch.zeros_like(soft)
    return soft, hard


def _check(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    grad_out: Tensor,
    beta: float,
    temperature: float,
) -> None:
    """Shape, dtype and layout checks; metadata only, so no host synchronisation."""
    if student_logits.dtype != torch.float32 or not teacher_logits.is_floating_point():
        raise TypeError(
            "jsd_chunk_ needs fp32 student logits and floating teacher logits, got student "
            f"{student_logits.dtype} and teacher {teacher_logits.dtype}"
        )
    if student_logits.dim() != 2 or teacher_logits.dim() != 2:
        raise ValueError("student_logits and teacher_logits must be 2-D (rows, vocabulary)")
    n, vs = student_logits.shape
    if teacher_logits.shape[0] != n or teacher_logits.shape[1] < vs:
        raise ValueError(
            f"teacher_logits {tuple(teacher_logits.shape)} must have the student's {n} rows and "
            f"at least its {vs} columns"
        )
    if not (student_logits.is_contiguous() and teacher_logits.is_contiguous()):
        raise ValueError("student_logits and teacher_logits must be contiguous")
    if labels.shape != (n,) or labels.dtype != torch.int64 or not labels.is_contiguous():
        raise ValueError(
            f"labels must be contiguous int64 of shape ({n},), got {labels.dtype} "
            f"{tuple(labels.shape)} strides {labels.stride()}"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if grad_out.shape != (n, vs) or grad_out.stride(1) != 1 or not grad_out.is_floating_point():
        raise ValueError(
            f"grad_out must be a floating ({n}, {vs}) tensor with unit column stride, got "
            f"{grad_out.dtype} {tuple(grad_out.shape)} strides {grad_out.stride()}"
        )
    tensors = (student_logits, teacher_logits, labels, grad_out)
    if len({t.device for t in tensors}) > 1:
        raise ValueError(
            f"all tensors must be on one device, got {[str(t.device) for t in tensors]}"
        )


def jsd_chunk_(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    grad_out: Tensor,
    options: LossOptions,
) -> tuple[Tensor, Tensor]:
    """Loss and logit gradient of one chunk; the Triton twin of ``_chunk_torch.jsd_chunk_``.

    student_logits: (n, Vs) fp32 contiguous raw student logits, bias included (left as they
    are here; the contract lets the PyTorch twin use them as scratch). teacher_logits: (n, Vt)
    contiguous, Vt >= Vs, fp32 or the matmul dtype (read as fp32; bf16 saves a third of the
    bytes); the scaled student logits are zero-padded to Vt as Liger-Kernel does, so padded
    columns take part in the student softmax but get no gradient. labels: (n,) int64.
    grad_out: (n, Vs) with unit column stride, receives d(Loss)/dlogits in its dtype, Loss =
    weight_soft * soft + weight_hard * hard summed over the valid rows; rows whose label ==
    ignore_index get zeros (the contract leaves them unspecified). It may be
    teacher_logits[:, :Vs] itself, as in the fused loss: each tile is read before the gradient
    is written over it, so the matmuls take the gradient in their dtype with no extra buffer.
    options: the loss options (:class:`~gradref_kernels._options.LossOptions`).

    Returns (soft_sum, hard_sum): 0-dim fp32, this chunk's unweighted losses summed over its
    valid rows (hard_sum is zero when not compute_hard).
    """
    rows, vocab_t = teacher_logits.shape
    shared = options.shares_softmax(student_logits.shape[1], vocab_t)
    block_v, num_warps = _default_config(rows, vocab_t, _soft_loss(options.beta), shared)
    return _launch(
        student_logits,
        teacher_logits,
        labels,
        grad_out=grad_out,
        options=options,
        block_v=block_v,
        num_warps=num_warps,
    )


def scaled_cast(
    source: Tensor, scale: Tensor, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``(source * scale).to(dtype)`` in one pass, rounded once, into ``out`` if given (a
    contiguous tensor of ``dtype`` and source's shape).

    source: contiguous float32; scale: a 0-dim tensor on source's device (read there, so no
    host synchronisation). The fused loss rounds its float32 gradients with it: the input
    gradient of each chunk by 1/num_valid, the weight-gradient sum by grad_output / num_valid
    in backward. PyTorch would take two passes (a cast and a multiply, rounding twice) or its
    slower mixed-dtype path.
    """
    if source.dtype != torch.float32 or not source.is_contiguous():
        raise ValueError(
            f"source must be a contiguous float32 tensor, got {source.dtype} "
            f"strides {source.stride()}"
        )
    if scale.dim() != 0 or scale.device != source.device:
        raise ValueError(
            f"scale must be a 0-dim tensor on {source.device}, got shape "
            f"{tuple(scale.shape)} on {scale.device}"
        )
    if out is None:
        out = torch.empty(source.shape, dtype=dtype, device=source.device)
    elif out.dtype != dtype or out.shape != source.shape or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {tuple(source.shape)}, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    numel = source.numel()
    if numel > 0:
        grid = (triton.cdiv(numel, _CAST_BLOCK),)
        _scaled_cast_kernel[grid](
            source,
            scale,
            out,
            numel,
            BLOCK=_CAST_BLOCK,
            INTERPRETED=not _compiled(),
            num_warps=8,
        )
    return out
