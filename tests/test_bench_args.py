"""The bench scripts refuse bad flags with an argparse error naming the flag (exit 2), before any
timing: no traceback, and no run that silently measures something else (``--cache warm`` used to
run the cold table under the label "warm", ``--batches 0`` printed 0 tok/s)."""
from __future__ import annotations

import importlib
import sys

import pytest

from tests.cluster_util import ROOT


@pytest.fixture(scope="module")
def bench_expert():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("bench_expert")
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("argv, flag, says", [
    (["--batches", "0"], "--batches", "at least 1"),
    (["--batches", "1,x"], "--batches", "expected an integer, got 'x'"),
    (["--threads", "0"], "--threads", "at least 1"),
    (["--threads", "x"], "--threads", "expected an integer"),
    (["--threads", "100000"], "--threads", "cores"),
    (["--cache", "warm"], "--cache", "hot and/or cold, got 'warm'"),
    (["--d-model", "100"], "--d-model", "multiple of 256"),
    (["--d-ff", "-256"], "--d-ff", "at least 1"),
    (["--repeat", "0"], "--repeat", "at least 1"),
    (["--max-cold-experts", "0"], "--max-cold-experts", "at least 2"),
])
def test_bench_expert_refuses_a_bad_flag_naming_it(bench_expert, capsys, argv, flag, says):
    with pytest.raises(SystemExit) as exc:
        bench_expert.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and says in err


def test_bench_expert_names_cold_variants_whose_working_set_stays_in_cache(bench_expert):
    """A VM reporting a 300 MiB LLC with the default 48-copy cap: Q4_K_M's 48 x 2.9 MiB stay
    cache-resident, and the "cold" table must say so instead of passing as cold."""
    from moe.ffn import ExpertWeights
    import numpy as np
    e = ExpertWeights(*(np.zeros((256, 256), np.float32) for _ in range(3)))  # 768 KiB per expert
    cycled = {"small": bench_expert.copies(e, 4), "big": bench_expert.copies(e, 64)}
    assert bench_expert.under_llc(cycled, llc=16 << 20) == ["small"]
