"""Sharded == monolithic whatever the BLAS thread count (issue 24 item 1).

On an AMD EPYC a DeepSeek-V3-shaped layer (64 routed experts, n_group 8, topk_group 3, top-6,
2 shared experts of shared d_ff 512, hidden 256) differed by 5.96e-08 from the monolithic
forward with multithreaded OpenBLAS and by 0 with ``OPENBLAS_NUM_THREADS=1``: the router's
logits (and a holder's products with ``--blas-threads N``) ran on the process's thread count.
Every product of the compared paths now runs on one BLAS thread (``BlasPin``).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

from moe.compute.cpu import CpuBackend
from moe.ffn import combine, expert_forward, moe_layer_forward
from moe.gating import route
from prepare.checkpoint import Checkpoint
from prepare.layouts import load_expert, load_gate, spec_from_config
from tenzro_site.verify import monolithic
from tests.synth import make_checkpoint


def blas_threads() -> int:
    return ThreadpoolController().select(user_api="blas").info()[0]["num_threads"]


class Spy(np.ndarray):
    """A weight whose ``.T`` (taken just before the product) records the BLAS thread count."""

    seen: list[int]

    @property
    def T(self):  # noqa: N802 (numpy's name)
        Spy.seen.append(blas_threads())
        return np.asarray(self).T


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = make_checkpoint(tmp_path_factory.mktemp("ds") / "ds", "deepseek_v3", hidden=256, d_ff=256, experts=64,
                           top_k=6, layers=2, n_group=8, topk_group=3, n_shared=2, scale=2.5, tokens=48)
    ck = Checkpoint(root)
    spec = spec_from_config(ck.config)
    gate = load_gate(ck, spec, 1)
    experts = {e: load_expert(ck, spec, 1, e) for e in range(gate.num_experts + 1)}
    x = np.random.default_rng(7).standard_normal((48, 256)).astype(np.float32)
    return ck, gate, experts, x


@pytest.mark.parametrize("threads", [2, 4])
def test_products_of_the_compared_paths_run_on_one_blas_thread(deepseek, threads):
    _, gate, experts, x = deepseek
    Spy.seen = []
    with threadpool_limits(limits=threads):
        assert blas_threads() == threads
        CpuBackend().matmul_xt(x, np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32).view(Spy))
        spied = type(gate)(**{**gate.__dict__})
        spied.weight = gate.weight.view(Spy)
        route(spied, x)
        assert blas_threads() == threads  # restored after each product
    assert Spy.seen == [1, 1], Spy.seen


@pytest.mark.parametrize("site", [1, 2, 4])
def test_sharded_equals_monolithic_with_1_2_and_4_blas_threads_on_both_sides(deepseek, site):
    """The router (routing, combine) with ``site`` threads; holders with 1, 2 and 4, several
    experts at once as a holder's compute pool runs them; the site's monolithic check with
    ``site`` threads and as ``verify_forward`` runs it: every output the same bits."""
    ck, gate, experts, x = deepseek
    with threadpool_limits(limits=site):
        routing = route(gate, x)
        mono, _ = moe_layer_forward(gate, experts, x)
    want = monolithic(ck, 1, x)
    assert np.array_equal(mono, want)
    for holder in (1, 2, 4):
        rows: dict[int, tuple] = {}

        def run(es, rows=rows):
            for e in es:
                tok = routing.tokens_by_expert()[e]
                rows[e] = (tok, expert_forward(experts[e], x[tok]))

        routed = sorted(routing.tokens_by_expert())
        with threadpool_limits(limits=holder):
            pool = [threading.Thread(target=run, args=(routed[i::3],)) for i in range(3)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        with threadpool_limits(limits=site):
            sharded = combine(routing, rows, gate.d_model)
        assert float(np.max(np.abs(sharded - want))) == 0.0, (site, holder)
