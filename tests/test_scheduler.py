"""The continuous-batching scheduler in process (``router.scheduler``, issue 21 items 1–4): a
sequence's tokens are the same alone or beside others (every fixture family, prompts
prefilled in chunks), per-sequence sampling inside one step, one distributed forward per
layer per step for all running sequences, chunked prefill mixed into decode steps, the KV
budget making requests wait, a full queue answering ``Busy``, a cancelled request freeing
its slot.

Models are published for real; with no holder online every layer forward runs on the site's
fallback replica (``router.fallback``) through ``Router.forward``. Waits are on events or
futures, never on wall-clock bounds.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from asgiref.sync import sync_to_async

from moe.backbone import BackboneError
from moe.backbone.decode import Sampling
from prepare.backbone import publish_backbone
from prepare.services import publish_checkpoint, publish_dense
from router.admission import Busy
from router.apps import current
from tests.conftest import DEEPSEEK, MIXTRAL, QWEN, QWEN2
from tests.test_backbone import local_model

pytestmark = pytest.mark.django_db(transaction=True)

FAMILIES = {"qwen3_moe": QWEN, "deepseek_v3": DEEPSEEK, "qwen2_moe": QWEN2, "mixtral": MIXTRAL}


def publish(path, model_id: str) -> None:
    publish_checkpoint(path, model_id)
    publish_dense(path, model_id, 2)  # DeepSeek's leading dense layers (None for the others)
    publish_backbone(path, model_id)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    """``n`` prompts of 2..20 token ids (deterministic)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, size=int(rng.integers(2, 21)))] for _ in range(n)]


async def scheduler(model_id: str):
    """The model's scheduler on the running loop."""
    from router.generate import served_model
    from router.scheduler import scheduler_for

    return scheduler_for(current(), await sync_to_async(served_model)(model_id))


# -- batch invariance: the backbone's math, every family ---------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_backbone_rows_do_not_depend_on_neighbours_or_chunks(family):
    """Greedy decode of one prompt, alone and whole, equals the same prompt prefilled in
    chunks of 3 beside 7 other sequences (their rows concatenated with its own in every
    norm, projection and MoE layer call): identical token ids and identical logits bits."""
    bb, mlp, _ = local_model(FAMILIES[family])
    target, others = prompts(1, seed=11)[0], prompts(7)

    def greedy_alone(p, n=6):
        cache = bb.new_cache()
        lg = bb.forward([np.asarray(p)], [cache], mlp)[0]
        out, last = [], [lg]
        for _ in range(n):
            out.append(int(np.argmax(lg[-1])))
            lg = bb.forward([np.asarray([out[-1]])], [cache], mlp)[0]
            last.append(lg)
        return out, last

    solo, solo_logits = greedy_alone(target)
    seqs = [target] + others
    caches = [bb.new_cache() for _ in seqs]
    fed, outs, logits0 = [0] * len(seqs), [[] for _ in seqs], []
    while len(outs[0]) < 6:
        ids, sel, who = [], [], []
        for i, p in enumerate(seqs):
            if fed[i] < len(p):
                n = min(3, len(p) - fed[i])
                ids.append(np.asarray(p[fed[i]:fed[i] + n]))
                sel.append("last" if fed[i] + n == len(p) else "none")
                fed[i] += n
            else:
                ids.append(np.asarray([outs[i][-1]]))
                sel.append("last")
            who.append(i)
        lgs = bb.forward(ids, [caches[i] for i in who], mlp, select=sel)
        for i, lg in zip(who, lgs):
            if lg is not None:
                if i == 0:
                    logits0.append(lg)
                outs[i].append(int(np.argmax(lg[-1])))
    assert outs[0] == solo
    for a, b in zip(logits0, solo_logits):
        assert np.array_equal(a[-1], b[-1])


# -- the scheduler through Router.forward ------------------------------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_scheduled_tokens_equal_solo_beside_others(family, settings):
    """Every fixture family: each request's greedy tokens beside 7 concurrent others (chunked
    prefill of 4 rows) equal its run alone, and the steps did carry several sequences."""
    from router.generate import generate

    model = f"sched-{family}"
    await sync_to_async(publish)(FAMILIES[family], model)
    settings.TENZRO = {**settings.TENZRO, "GEN_PREFILL_CHUNK": 4}
    ps = prompts(8)
    solo = [(await generate(model, p, Sampling(max_new_tokens=5)))["output_ids"] for p in ps[:3]]
    together = await asyncio.gather(*(generate(model, p, Sampling(max_new_tokens=5)) for p in ps))
    assert [r["output_ids"] for r in together[:3]] == solo
    sched = await scheduler(model)
    assert max(n for n, _ in sched.step_sizes) > 1
    assert all(rows <= n + 4 for n, rows in sched.step_sizes)  # decode rows + one chunk budget


@pytest.mark.asyncio
async def test_one_forward_per_layer_per_step_and_sampling_per_sequence(settings):
    """Eight requests with their own sampling (greedy, seeded temperature/top-k/top-p, a stop
    id) share steps: each gets what it gets alone, and a step's forwards are one per MoE
    layer and micro-batch however many sequences ran in it."""
    from router.generate import generate

    model = "sched-sampling"
    await sync_to_async(publish)(QWEN, model)
    ps = prompts(8, seed=5)
    samplings = [Sampling(max_new_tokens=6, temperature=0.8 * (i % 2), top_k=(i % 3) * 5,
                          top_p=1.0 if i % 4 else 0.9, seed=i, stop=(7,) if i == 5 else ()) for i in range(8)]
    solo = [(await generate(model, p, s))["output_ids"] for p, s in zip(ps, samplings)]
    sched = await scheduler(model)
    steps_before = sched.steps
    forwards: list[int] = []
    real = current().forward

    async def counting(*args, **kw):
        forwards.append(1)
        return await real(*args, **kw)

    current().forward = counting
    try:
        together = await asyncio.gather(*(generate(model, p, s) for p, s in zip(ps, samplings)))
    finally:
        del current().forward
    assert [r["output_ids"] for r in together] == solo
    steps = sched.steps - steps_before  # one forward per layer per micro-batch of each step
    assert len(forwards) == sum(e["microbatches"] for e in list(sched.timeline)[-steps:]) * len(sched.served.moe_layers)


@pytest.mark.asyncio
async def test_long_prompt_is_prefilled_in_chunks_while_others_decode(settings):
    """A 100-token prompt arriving while a stream decodes is prefilled 8 rows a step: the
    stream gains tokens in the steps before the long prompt's first token."""
    from router.generate import generate

    model = "sched-chunks"
    await sync_to_async(publish)(QWEN, model)
    settings.TENZRO = {**settings.TENZRO, "GEN_PREFILL_CHUNK": 8}
    events: list[str] = []
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_a(seqs):
        events.append("a")
        loop.call_soon_threadsafe(started.set)

    def on_b(seqs):
        events.append("b")

    a = asyncio.ensure_future(generate(model, [1, 2, 3], Sampling(max_new_tokens=100), on_tokens=on_a))
    await started.wait()
    mark = len(events)
    b = await generate(model, [int(t) % 256 for t in range(100)], Sampling(max_new_tokens=2), on_tokens=on_b)
    first_b = events.index("b", mark)
    assert events[mark:first_b].count("a") >= 100 // 8 - 1
    assert len((await a)["output_ids"]) == 100 and len(b["output_ids"]) == 2


@pytest.mark.asyncio
async def test_kv_budget_makes_requests_wait_and_bounds_a_sequence(settings):
    """With room for one sequence's KV cache, three requests run one after another (each
    step carries one sequence) and all finish; a sequence bigger than the budget is refused."""
    from router.generate import generate, served_model
    from router.scheduler import kv_reservation

    model = "sched-budget"
    await sync_to_async(publish)(QWEN, model)
    served = await sync_to_async(served_model)(model)
    one = kv_reservation(served.backbone, 8, 4)  # any two of the three need more
    settings.TENZRO = {**settings.TENZRO, "GEN_KV_BUDGET_BYTES": one}
    ps = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    results = await asyncio.gather(*(generate(model, p, Sampling(max_new_tokens=4)) for p in ps))
    assert [len(r["output_ids"]) for r in results] == [4, 4, 4]
    sched = await scheduler(model)
    assert max(n for n, _ in sched.step_sizes) == 1
    with pytest.raises(BackboneError) as exc:
        await generate(model, [1] * 30, Sampling(max_new_tokens=4))
    assert exc.value.field == "max_new_tokens" and "TENZRO_KV_BUDGET_BYTES" in str(exc.value)


@pytest.mark.asyncio
async def test_full_queue_is_busy_and_cancel_frees_the_slot(settings):
    """One running, one waiting: the third request gets ``Busy`` with a retry hint; cancelling
    the running one lets the waiting one run to its end."""
    from router.generate import generate

    model = "sched-queue"
    await sync_to_async(publish)(QWEN, model)
    settings.TENZRO = {**settings.TENZRO, "GEN_MAX_RUNNING": 1, "GEN_QUEUE": 1}
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    first = asyncio.ensure_future(generate(model, [1, 2], Sampling(max_new_tokens=120),
                                           on_tokens=lambda s: loop.call_soon_threadsafe(started.set)))
    await started.wait()
    second = asyncio.ensure_future(generate(model, [3, 4], Sampling(max_new_tokens=3)))
    sched = await scheduler(model)
    deadline = loop.time() + 60
    while sched.counts() != (1, 1) and loop.time() < deadline:  # the second waits behind the first
        await asyncio.sleep(0.02)
    assert sched.counts() == (1, 1)
    with pytest.raises(Busy) as exc:
        await generate(model, [5, 6], Sampling(max_new_tokens=3))
    assert exc.value.retry_after_s > 0
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len((await second)["output_ids"]) == 3
    snap = current().metrics.snapshot()
    outcomes = {s["labels"]["outcome"] for s in snap["tenzro_requests_total"] if s["labels"]["model"] == model}
    assert {"ok", "cancelled"} <= outcomes


# -- where a step's backbone compute runs ------------------------------------------------------

def test_backbone_steps_equal_forward():
    """``forward_steps`` driven by hand (the scheduler awaits each layer's MLP between two
    segments) yields one C-contiguous float32 ``[N, H]`` per layer and returns exactly the
    logits and cache of ``forward``."""
    bb, mlp, _ = local_model(QWEN)
    ids = [np.asarray(p) for p in prompts(3, seed=2)]
    whole = [bb.new_cache() for _ in ids]
    want = bb.forward(ids, whole, mlp, select=["all", "last", "none"])
    caches = [bb.new_cache() for _ in ids]
    steps = bb.forward_steps(ids, caches, select=["all", "last", "none"])
    layers, out = [], None
    while True:
        try:
            layer, x = steps.send(out)
        except StopIteration as done:
            got = done.value
            break
        assert x.dtype == np.float32 and x.flags.c_contiguous and x.shape == (sum(i.size for i in ids), bb.hidden_size)
        layers.append(layer)
        out = mlp(layer, x)
    assert layers == list(range(bb.num_layers))
    assert got[2] is None and all(np.array_equal(a, b) for a, b in zip(got[:2], want[:2]))
    assert [c.length for c in caches] == [c.length for c in whole] == [i.size for i in ids]
    with pytest.raises(BackboneError):
        next(bb.forward_steps([np.asarray([bb.vocab_size])], [bb.new_cache()]))


def test_compute_placement_keeps_short_segments_on_the_loop():
    from router.scheduler import ComputePlacement

    p = ComputePlacement()
    assert p.inline(16) and not p.inline(17)  # nothing measured: small steps on the loop
    p.observe(4, 0.3)  # 4..7 rows: 0.3 ms a segment
    assert p.inline(4) and p.inline(2)  # measured; a smaller class is taken from the nearest larger one
    assert p.inline(16)  # scaled from 4..7 rows: 1.2 ms
    assert not p.inline(512)  # scaled: 38 ms, a worker thread
    p.observe(16, 5.0)  # a long segment at 16..31 rows (a large model)
    assert not p.inline(16) and p.inline(4)
    for _ in range(20):  # it got short again
        p.observe(16, 0.5)
    assert p.inline(16)
    p.observe(0, 1.0)  # nothing to learn from
    p.observe(8, -1.0)
    assert p.expected_ms(8) == pytest.approx(0.6)  # still scaled from 4..7 rows


@pytest.mark.asyncio
async def test_compute_in_worker_threads_gives_the_tokens_of_the_loop(settings):
    """Six greedy requests and one sampled one get the same tokens whether each step's
    backbone compute ran on the event loop's thread (a small model) or in worker threads (a
    large one), and it ran where the placement said."""
    import threading

    from router.generate import generate

    model = "sched-placement"
    await sync_to_async(publish)(QWEN, model)
    settings.TENZRO = {**settings.TENZRO, "GEN_PREFILL_CHUNK": 4}
    ps = prompts(7, seed=21)
    samplings = [Sampling(max_new_tokens=5)] * 6 + [Sampling(max_new_tokens=5, temperature=0.9, top_p=0.9, seed=4)]
    sched = await scheduler(model)
    bb = sched.served.backbone
    threads: set[int] = set()
    real = bb.attention_rows

    def recording(*args, **kw):
        threads.add(threading.get_ident())
        return real(*args, **kw)

    bb.attention_rows = recording
    try:
        sched.placement.inline = lambda rows: True  # as for a small model
        on_loop = await asyncio.gather(*(generate(model, p, s) for p, s in zip(ps, samplings)))
        assert threads == {threading.get_ident()}
        threads.clear()
        sched.placement.inline = lambda rows: False  # as for a large model
        in_threads = await asyncio.gather(*(generate(model, p, s) for p, s in zip(ps, samplings)))
        assert threads and threading.get_ident() not in threads
    finally:
        del bb.attention_rows, sched.placement.inline
    assert [r["output_ids"] for r in in_threads] == [r["output_ids"] for r in on_loop]
