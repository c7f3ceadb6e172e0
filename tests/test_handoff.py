"""Prefill/Decode disaggregation: the handoff format, role checks, and a real cluster where an
agent with role Prefill runs the prompt and one with role Decode continues it."""
from __future__ import annotations

import pytest
from safetensors.numpy import load_file

from moe.backbone.decode import Generator, Sampling
from moe.handoff import HandoffError, RoleRunner, pack_handoff, unpack_handoff
from tests.cluster_util import env_for, rpc, running_cluster
from tests.conftest import QWEN
from tests.test_backbone import local_model

REF = load_file(str(QWEN / "generation_reference.safetensors"))
PROMPT = [int(t) for t in REF["input_ids"][0]]
GREEDY = [int(t) for t in REF["greedy_ids"][0][16:]]


def test_handoff_roundtrip_keeps_cache_and_rng():
    """Prefill, pack, unpack, resume == one uninterrupted seeded sampling run."""
    bb, mlp, _ = local_model(QWEN)
    s = Sampling(max_new_tokens=6, temperature=0.8, top_k=20, seed=11)
    whole = Generator(bb, mlp, s).run([REF["input_ids"][0], REF["input_ids"][0][:5]])
    g = Generator(bb, mlp, s)
    seqs = unpack_handoff(pack_handoff(g.prefill([REF["input_ids"][0], REF["input_ids"][0][:5]])))
    Generator(bb, mlp, s).resume(seqs)
    assert [x.output for x in seqs] == [x.output for x in whole]
    assert [x.cache.length for x in seqs] == [x.cache.length for x in whole]


def test_malformed_handoff_and_wrong_role_are_refused():
    with pytest.raises(HandoffError):
        unpack_handoff(b"\x05\x00\x00\x00{bad}")
    runner = RoleRunner(("ExpertHolder", "Decode"), "http://127.0.0.1:1", lambda u: b"", lambda: 1 << 20)
    with pytest.raises(HandoffError, match="do not take 'prefill'"):
        runner.handle("prefill", {"session": "s"}, b"")
    with pytest.raises(HandoffError, match="missing or incomplete"):
        runner.handle("decode", {"session": "s"}, b"")


@pytest.mark.cluster
def test_prefill_on_one_agent_decode_on_another(tmp_path):
    env = env_for(tmp_path)
    env["TENZRO_WS_MAX_MESSAGE"] = "80000"  # a small frame cap: the 32 KiB cache must travel in several frames
    with running_cluster(tmp_path, [QWEN], holders=2, env=env,
                         extra=("--agent-role", "Prefill", "--agent-role", "Decode")) as (info, _):
        base = {"model_id": "qwen3-moe-tiny", "input_ids": PROMPT, "max_new_tokens": 8, "carrier": "f32"}
        r = rpc(info["rpc"], "tenzro_moeGenerate", {**base, "handoff": True}, timeout=300)["result"]
        assert r["output_ids"] == GREEDY
        kv = r["kv_handoff"]
        pre, dec = kv["from"], kv["to"]
        assert pre != dec and {pre, dec} == {a["provider"] for a in info["agents"]}
        assert kv["frames"] > 1 and kv["bytes"] > kv["kv_bytes"] == 2 * 2 * 2 * 64 * 4 * len(PROMPT)
        # seeded sampling: the RNG state travels with the cache, so the tokens equal a PrefillDecode run
        sampled = {**base, "temperature": 0.9, "top_k": 30, "seed": 5, "input_ids": [PROMPT, PROMPT[:7]]}
        local = rpc(info["rpc"], "tenzro_moeGenerate", sampled, timeout=300)["result"]
        moved = rpc(info["rpc"], "tenzro_moeGenerate", {**sampled, "handoff": True}, timeout=300)["result"]
        assert moved["output_ids"] == local["output_ids"]
        err = rpc(info["rpc"], "tenzro_moeGenerate", {**base, "handoff": True, "return_logits": True})["error"]
        assert err["code"] == -32602 and err["data"]["field"] == "return_logits"
