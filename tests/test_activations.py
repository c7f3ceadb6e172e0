"""The one sigmoid / silu of the numeric core: bit-identical to the formulas the router and the
experts used inline (torch CPU form), right limits on overflow, no warnings."""
import warnings

import numpy as np

from moe.activations import sigmoid, silu


def _vals():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(4096) * 20).astype(np.float32)
    return np.concatenate([x, np.float32([0.0, -0.0, 100.0, -100.0, 1e30, -1e30])])


def test_silu_matches_division_form_bitwise():
    g = _vals()
    with np.errstate(over="ignore"):
        ref = g / (np.float32(1) + np.exp(-g.astype(np.float64)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = silu(g)
    assert y.dtype == np.float32
    t = np.negative(g)
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    t += np.float32(1)
    assert np.array_equal(y.view(np.uint32), (g / t).view(np.uint32))
    assert np.allclose(y, ref, rtol=1e-6, atol=0)
    assert y[-1] == 0 and np.signbit(y[-1])  # exp overflow: -0.0, not NaN
    assert y[-2] == np.float32(1e30)


def test_silu_in_place_and_alpha():
    g = _vals()
    keep = g.copy()
    y = silu(g, alpha=1.702)
    assert np.array_equal(g, keep)  # input untouched without out=
    t = g * np.float32(-1.702)
    with np.errstate(over="ignore", under="ignore"):
        np.exp(t, out=t)
    t += np.float32(1)
    assert np.array_equal(y.view(np.uint32), (g / t).view(np.uint32))
    out = silu(g, out=g)
    assert out is g and np.array_equal(g.view(np.uint32), silu(keep).view(np.uint32))


def test_sigmoid_in_place_with_limits():
    z = np.float32([-1e4, 0.0, 1e4, 2.0])
    with np.errstate(over="ignore"):
        ref = (1 / (1 + np.exp(-z.astype(np.float64)))).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = sigmoid(z)
    assert s is z
    assert s[0] == 0 and s[1] == np.float32(0.5) and s[2] == 1
    assert abs(float(s[3]) - float(ref[3])) <= 1e-7
