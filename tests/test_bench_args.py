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


@pytest.fixture(scope="module")
def bench_serving():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("bench_serving")
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("argv, flag, says", [
    (["--concurrency", "0"], "--concurrency", "at least 1"),
    (["--concurrency", "4,x"], "--concurrency", "expected an integer, got 'x'"),
    (["--requests-per-client", "0"], "--requests-per-client", "at least 1"),
    (["--modes", "local"], "--modes", "distributed, in-process, llama-server, got 'local'"),
    (["--prompt", "100", "--tokens", "100"], "--tokens", "over the fixture's context of 128"),
])
def test_bench_serving_refuses_a_bad_flag_naming_it(bench_serving, capsys, argv, flag, says):
    with pytest.raises(SystemExit) as exc:
        bench_serving.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and says in err


def test_bench_serving_tokenizer_is_bytes_and_table_has_ratios(bench_serving):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(bench_serving.byte_tokenizer_json())
    text = "Hello, wörld"
    assert tok.encode(text).ids == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert tok.get_vocab_size() == 256
    assert bench_serving.mode_list("in-process,distributed") == ["distributed", "in-process"]
    export = {"output_token_throughput": {"avg": 40.0}, "request_count": {"avg": 8},
              "time_to_first_token": {"p50": 100.0, "p99": 300.0}, "inter_token_latency": {"p50": 20.0, "p99": 50.0},
              "error_summary": [{"error_details": {"code": 429}, "count": 2}]}
    row = bench_serving.summarize(export, 4)
    assert row["errors"] == 2 and row["tokens_per_s"] == 40.0 and row["itl_ms"] == {"p50": 20.0, "p99": 50.0}
    one = {**row, "concurrency": 1, "tokens_per_s": 10.0}
    lines = bench_serving.table({"distributed": [one, row], "in-process": [{**one, "tokens_per_s": 20.0},
                                                                          {**row, "tokens_per_s": 50.0}]})
    dist4 = next(x for x in lines if x.startswith("distributed") and x.split()[1] == "4").split()
    assert dist4[5] == "4.00" and dist4[-1] == "0.80" and dist4[-2] == "2.50"  # ×C=1, p99/p50, dist÷in


def test_bench_serving_reads_holder_numbers_from_aiperfs_scrape_of_metrics(bench_serving):
    server = {"metrics": {
        "tenzro_holder_batch_seconds": {"series": [{"labels": {"provider": "a" * 64},
                                                    "stats": {"count": 10, "p50_estimate": 0.015, "p99_estimate": 0.1}}]},
        "tenzro_holder_batch_failures": {"series": [{"labels": {"provider": "b" * 64}, "stats": {"total": 3.0}}]}}}
    assert bench_serving.holder_stats(server) == {
        "a" * 12: {"batches": 10, "failures": 0, "p50_ms": 15.0, "p99_ms": 100.0},
        "b" * 12: {"batches": 0, "failures": 3, "p50_ms": None, "p99_ms": None}}
    assert bench_serving.holder_stats(None) == {}


def test_bench_serving_kills_a_hung_aiperf_and_its_children(bench_serving, tmp_path):
    """A load generator stuck on a wedged site is killed with every process it forked."""
    fake = tmp_path / "aiperf"
    pids = tmp_path / "pids"
    fake.write_text(f"#!/bin/sh\nsleep 600 & echo $! > {pids}\nsleep 600\n")
    fake.chmod(0o755)
    with pytest.raises(bench_serving.RunFailed, match="still running"):
        bench_serving.run_aiperf(str(fake), "http://127.0.0.1:9", "m", tmp_path, 1, 1, 8, 8, tmp_path / "out",
                                 request_timeout=1, startup_s=1)
    child = int(pids.read_text())
    from tests.cluster_util import pid_alive
    assert not pid_alive(child)


@pytest.mark.django_db
def test_bench_big_holder_declares_slots_the_site_accepts():
    """The bench's 100,000 holdings name slots of a model the site knows: heartbeats naming a
    slot the model lacks are refused (registry.heartbeat), so the bench once died on kimi-k2's
    l0/e0 (a dense layer) before measuring anything."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        big = importlib.import_module("bench_big_holder")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from registry.heartbeat import _model_slots

    big.publish_shape()
    slots = _model_slots({big.MODEL})[big.MODEL]
    held = big.holdings(True)
    assert len(held) == big.N and all((h["layer"], h["expert"]) in slots for h in held)
