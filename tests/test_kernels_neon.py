"""The ARM NEON paths of the native kernels (``neon``; ``neondot`` with the dot-product
extension), bit for bit against the numpy model of the contract on ggml's golden quantized bytes,
random and adversarial blocks: ``native/neon_check.c`` cross-compiled with Debian's aarch64
toolchain (``gcc-aarch64-linux-gnu``) and run under ``qemu-user`` (Python under qemu is too slow),
on an emulated CPU with the dot-product extension (``-cpu max``: portable, neon and neondot) and
one without (``-cpu cortex-a53``: portable and neon; neondot must be refused).

Skipped when the cross toolchain or qemu is absent, except with ``TENZRO_REQUIRE_SERVICES=1``
(CI: ``.ci/run`` installs both), where that fails."""
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moe.quant import QuantizedMatrix
from tests.test_kernels import GOLDEN, _random_blocks, model_matmul

ROOT = Path(__file__).resolve().parents[1]
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
QT = {"q8_0": 0, "q4_k": 1, "q6_k": 2}


@pytest.fixture(scope="module")
def neon_check(tmp_path_factory):
    missing = [t for t in (CC, QEMU) if shutil.which(t) is None]
    if missing:
        msg = (f"{' and '.join(missing)} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user): "
               "the NEON paths are not checked")
        if os.environ.get("TENZRO_REQUIRE_SERVICES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    exe = tmp_path_factory.mktemp("neon") / "neon_check"
    r = subprocess.run([CC, "-O2", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-static", "-Wall",
                        "-Wno-unknown-pragmas", "-Wno-unused-function", f"-I{ROOT / 'native'}", str(ROOT / "native" / "neon_check.c"),
                        "-o", str(exe), "-lm"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return exe


def _cases():
    """(matrix, activations) pairs: golden bytes, random blocks over odd shapes, rounding ties."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 2048), dtype=np.float32)
    x[1] *= 1e-3
    x[2, :256] = 0.0
    z = np.load(GOLDEN)
    for case in ("normal", "heavy", "uniform_pos", "uniform_neg", "edge", "bf16"):
        for key, q in (("q8_0", "q8_0"), ("q4_K", "q4_k"), ("q6_K", "q6_k")):
            yield QuantizedMatrix(q, (8, 2048), z[f"{case}__{key}"]), x
    for q, cols in (("q8_0", 32 * 13), ("q8_0", 32 * 61), ("q4_k", 768), ("q6_k", 512)):
        m = _random_blocks(q, 37, cols, rng)
        xr = (rng.standard_normal((5, cols)) * rng.choice([1e-30, 1.0, 1e4], size=(5, 1))).astype(np.float32)
        yield m, xr
    halves = (np.arange(512) % 64 - 32 + 0.5).astype(np.float32)
    xt = np.stack([halves, halves * np.float32(1e-3)])
    xt[0, ::32] = 127.0
    for q in QT:
        yield _random_blocks(q, 9, 512, np.random.default_rng(2)), xt


def _write_cases(path: Path) -> int:
    cases = list(_cases())
    with open(path, "wb") as f:
        f.write(b"TKG1" + struct.pack("<I", len(cases)))
        for m, x in cases:
            rows, cols = m.shape
            f.write(struct.pack("<4I", QT[m.qtype], rows, cols, x.shape[0]))
            f.write(m.blocks.tobytes())
            f.write(np.ascontiguousarray(x, np.float32).tobytes())
            f.write(model_matmul(x, m).astype(np.float32).tobytes())
    return len(cases)


@pytest.mark.parametrize("cpu, paths", [("max", ("portable", "neon", "neondot")), ("cortex-a53", ("portable", "neon"))])
def test_neon_paths_bit_identical_under_qemu(neon_check, tmp_path, cpu, paths):
    n = _write_cases(tmp_path / "cases.bin")
    r = subprocess.run([QEMU, "-cpu", cpu, str(neon_check), str(tmp_path / "cases.bin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = set(r.stdout.splitlines())
    for p in paths:
        assert f"path {p}: {n}/{n} cases bit-identical" in lines, r.stdout
    if "neondot" not in paths:
        assert "path neondot: not supported by this CPU" in lines, r.stdout
