"""The demo's summary says what each check is (issue 24 item 15): a q4_k_m row at 1.35e-01 vs
transformers was marked ``ok``, which was about sharded == monolithic only."""
from __future__ import annotations

from tenzro_site.management.commands.tenzro_demo import row_checks


def test_quantized_row_names_its_checks():
    quant = {"max_rel_err_vs_reference": 0.135, "max_abs_diff_vs_monolithic": 0.0, "max_rel_err_vs_dense": 0.12,
             "quant": "q4_k_m", "ms": 12.5, "ok": True}
    line = row_checks(quant)
    assert "yes" in line and "not checked (q4_k_m)" in line and " ok" not in line
    dense = {"max_rel_err_vs_reference": 3e-7, "max_abs_diff_vs_monolithic": 0.0, "ms": 3.0, "ok": True}
    assert row_checks(dense).split()[-2:] == ["yes", "ok"]
    off = {**dense, "max_rel_err_vs_reference": 2e-3, "max_abs_diff_vs_monolithic": 1e-8, "ok": False}
    assert "NO (FAILED)" in row_checks(off) and row_checks(off).endswith("FAILED")
    assert "not checked (quantized)" in row_checks({**quant, "quant": {"gate": "Q4_K"}})
