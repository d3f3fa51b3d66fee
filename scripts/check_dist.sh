#!/usr/bin/env bash
# Builds the wheel and the sdist with `python -m build`, installs each in a fresh virtual
# environment and runs a smoke test there, outside the checkout, so that only the installed
# package is imported. torch is installed pinned (GRADREF_TORCH, as in setup.sh), once.
# Run from .venv (CI: after scripts/setup.sh, which installs `build` with the lint extra).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || {
    cat "$work/build.log"
    exit 1
}
wheel=("$work"/dist/*.whl)
sdist=("$work"/dist/*.tar.gz)
echo "built ${wheel[0]##*/} and ${sdist[0]##*/}"
sdist_files="$(tar -tzf "${sdist[0]}")"
for member in LICENSE CHANGELOG.md pytest_gradref/py.typed; do
    grep -q "/$member\$" <<<"$sdist_files" || { echo "the sdist lacks $member"; exit 1; }
done
wheel_files="$(python -m zipfile -l "${wheel[0]}")"
for member in licenses/LICENSE pytest_gradref/py.typed gradref_kernels/__init__.py; do
    grep -q "$member" <<<"$wheel_files" || { echo "the wheel lacks $member"; exit 1; }
done
# Test support (conftest.py, test modules, the float64 chunk oracle) lives under tests/ and
# stays out of the wheel: it holds the two packages and its .dist-info only, and no file named
# like one under tests/ (which catches a helper copied back into a package).
python - "${wheel[0]}" tests <<'PY'
import sys
import zipfile
from pathlib import Path

wheel, tests = sys.argv[1], Path(sys.argv[2])
names = zipfile.ZipFile(wheel).namelist()
test_support = {path.name for path in tests.rglob("*.py")} - {"__init__.py"}
tops = {name: name.split("/", 1)[0] for name in names}
outside = [name for name, top in tops.items()
           if top not in ("pytest_gradref", "gradref_kernels") and not top.endswith(".dist-info")]
leaked = [name for name in names if name.rsplit("/", 1)[-1] in test_support]
if outside or leaked:
    sys.exit(f"the wheel holds test support or stray files: {sorted(outside + leaked)}")
PY

python -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install --quiet)
"${pip[@]}" "${GRADREF_TORCH:-torch==2.13.0}"

mkdir "$work/smoke"
cat >"$work/smoke/test_smoke.py" <<'PY'
import pytest_gradref
import torch
from gradref_kernels import fused_linear_jsd
from gradref_kernels.reference import jsd_distillation_reference


def test_installed_not_the_checkout():
    assert "site-packages" in pytest_gradref.__file__


def test_reference_and_kernel(grad_reference, gradref_device):
    n, h, v = 12, 16, 40
    x = torch.randn(n, h, device=gradref_device)
    w = torch.randn(v, h, device=gradref_device) / 4
    tx = torch.randn(n, h, device=gradref_device)
    tw = torch.randn(v, h, device=gradref_device) / 4
    labels = torch.randint(0, v, (n,), device=gradref_device)
    ref = grad_reference(jsd_distillation_reference, x, w, tx, tw, labels, argnums=(0, 1))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_jsd(xx, ww, tx, tw, labels, chunk_size=5)
    loss.backward()
    ref.assert_close(loss, (xx.grad, ww.grad), rtol=1e-4, atol=1e-5)
PY
# The wheel brings the dependencies (torch is there already); the sdist then replaces the
# package alone, so torch is not reinstalled.
reinstall=()
for dist in "${wheel[0]}" "${sdist[0]}"; do
    "${pip[@]}" "${reinstall[@]}" "$dist"
    reinstall=(--force-reinstall --no-deps)
    (cd "$work/smoke" && "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
        --gradref-device=cpu test_smoke.py) | tail -n 1
    echo "smoke test passed: ${dist##*/}"
done
