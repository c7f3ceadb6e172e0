"""Expert-host runtime: tiers (LRU eviction order, spill, promotion, restart re-index,
readahead, budget accounting), metering, errors, the shared execution methods, and the
compute seam (CPU quantized kernels; GPU backends skipped where absent)."""
from __future__ import annotations

import base64
import importlib.util

import numpy as np
import pytest

from moe import compute, methods, quant, rowwise, wire
from moe.compute.cpu import CpuBackend, dequantize_matrix, quantized_matmul_xt
from moe.ffn import ExpertWeights, expert_forward
from moe.gating import Gate
from moe.metering import Meter
from moe.quant import QuantizedMatrix
from moe.runtime import (BadBlob, DimensionMismatch, ExpertNotLoaded, ExpertRuntime, GateNotLoaded,
                             NonFiniteInput, default_memory_budget)
from moe.blobs import blob_hash
from moe.jsonrpc import RpcError

H, F = 64, 32


def expert(seed: int, h: int = H, f: int = F) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    return ExpertWeights(rng.standard_normal((f, h), dtype=np.float32) * 0.1,
                         rng.standard_normal((f, h), dtype=np.float32) * 0.1,
                         rng.standard_normal((h, f), dtype=np.float32) * 0.1)


EXPERT_BYTES = expert(0).nbytes  # 3 * 64 * 32 * 4


def gate_blob(e: int = 4, h: int = H) -> bytes:
    w = np.random.default_rng(9).standard_normal((e, h), dtype=np.float32)
    return Gate(family="qwen3_moe", weight=w, top_k=2, norm_topk_prob=True).to_blob()


def rows(n: int, h: int = H, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, h), dtype=np.float32)


def tiers(rt: ExpertRuntime, model="m", layer=0) -> dict[int, str]:
    return {e["expert"]: e["tier"] for e in rt.status()["experts"] if e["model_id"] == model and e["layer"] == layer}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


# ---- tiers ----------------------------------------------------------------------------

def test_eviction_is_least_recently_used_and_spills_to_disk(tmp_path):
    rt = ExpertRuntime(memory_budget=2 * EXPERT_BYTES, disk_dir=tmp_path)
    for e in range(2):
        rt.load_expert("m", 0, e, expert(e).to_blob())
    rt.execute("m", 0, 0, rows(1), 1)  # expert 0 becomes most recently used
    rt.load_expert("m", 0, 2, expert(2).to_blob())
    assert tiers(rt) == {0: "memory", 1: "disk", 2: "memory"}
    st = rt.status()
    assert (st["evicted_to_disk"], st["evicted_dropped"], st["memory_experts"], st["disk_experts"]) == (1, 0, 2, 1)
    assert {h["expert"]: h["residency"] for h in rt.holdings()} == {0: "Warm", 1: "Cold", 2: "Warm"}
    rt.load_expert("m", 0, 3, expert(3).to_blob())  # next LRU victim is 0 (2 is newer)
    assert tiers(rt) == {0: "disk", 1: "disk", 2: "memory", 3: "memory"}


def test_promotion_from_disk_serves_identical_rows_and_evicts_the_lru(tmp_path):
    rt = ExpertRuntime(memory_budget=2 * EXPERT_BYTES, disk_dir=tmp_path)
    for e in range(3):
        rt.load_expert("m", 0, e, expert(e).to_blob())
    assert tiers(rt)[0] == "disk"
    x = rows(3)
    out = rt.execute("m", 0, 0, x, 3)
    np.testing.assert_array_equal(out, expert_forward(expert(0), x))
    assert tiers(rt) == {0: "memory", 1: "disk", 2: "memory"}
    assert rt.status()["promotions"] == 1


def test_without_disk_tier_evicted_experts_are_dropped_and_no_longer_declared():
    rt = ExpertRuntime(memory_budget=2 * EXPERT_BYTES)
    for e in range(3):
        rt.load_expert("m", 0, e, expert(e).to_blob())
    assert [h["expert"] for h in rt.holdings()] == [1, 2]
    assert rt.status()["evicted_dropped"] == 1
    with pytest.raises(ExpertNotLoaded):
        rt.execute("m", 0, 0, rows(1), 1)


def test_restart_reindexes_disk_tier_and_drops_leftovers(tmp_path):
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    for e in range(3):
        rt.load_expert("m/x:y", 1, e, expert(e).to_blob())
    rt.load_gate("m/x:y", 1, gate_blob())
    (tmp_path / "expert-junk.blob.123.tmp").write_bytes(b"partial")
    (tmp_path / "expert-orphan.blob").write_bytes(b"no sidecar")
    uris = {h["expert"]: h["blob_uri"] for h in rt.holdings()}

    rt2 = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    assert {h["expert"]: h["residency"] for h in rt2.holdings()} == {0: "Cold", 1: "Cold", 2: "Cold"}
    assert {h["expert"]: h["blob_uri"] for h in rt2.holdings()} == uris
    assert rt2.status()["gates"][0]["num_experts"] == 4
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "expert-orphan.blob").exists()
    x = rows(2)
    np.testing.assert_array_equal(rt2.execute("m/x:y", 1, 2, x, 2), expert_forward(expert(2), x))
    assert tiers(rt2, "m/x:y", 1)[2] == "memory"


def test_corrupted_disk_copy_is_detected_on_promotion_and_dropped(tmp_path):
    rt = ExpertRuntime(memory_budget=EXPERT_BYTES, disk_dir=tmp_path)
    for e in range(2):
        rt.load_expert("m", 0, e, expert(e).to_blob())
    path = rt.disk.path("expert", "m", 0, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BadBlob, match="disk corruption"):
        rt.execute("m", 0, 0, rows(1), 1)
    assert not rt.has("m", 0, 0) and rt.has("m", 0, 1)


def test_readahead_promotes_only_disk_members(tmp_path):
    rt = ExpertRuntime(memory_budget=3 * EXPERT_BYTES, disk_dir=tmp_path)
    for e in range(5):
        rt.load_expert("m", 0, e, expert(e).to_blob())
    assert tiers(rt) == {0: "disk", 1: "disk", 2: "memory", 3: "memory", 4: "memory"}
    assert rt.readahead("m", [(0, 0), (0, 1), (0, 4), (0, 99), (7, 0)]) == 2
    assert tiers(rt) == {0: "memory", 1: "memory", 2: "disk", 3: "disk", 4: "memory"}
    assert rt.status()["promotions"] == 2


def test_budget_counts_experts_and_gates_and_quantized_block_bytes(tmp_path):
    qw = ExpertWeights(*(QuantizedMatrix("q8_0", m.shape, quant.quantize(m, "q8_0"))
                         for m in (expert(1).gate_proj, expert(1).up_proj, expert(1).down_proj)))
    assert qw.nbytes == 3 * F * H // 32 * 34 and qw.quant == "q8_0"
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    rt.load_expert("m", 0, 1, expert(1).to_blob())
    assert rt.memory_bytes == 2 * EXPERT_BYTES
    g = rt.load_gate("m", 0, gate_blob())
    st = rt.status()
    assert g["approx_bytes"] == 4 * H * 4
    assert [e["approx_bytes"] for e in st["experts"]] == [EXPERT_BYTES, EXPERT_BYTES]
    assert st["memory_bytes"] == 2 * EXPERT_BYTES and st["gate_bytes"] == g["approx_bytes"]
    assert st["total_bytes"] == st["memory_bytes"] + st["gate_bytes"]
    rt.load_expert("m", 0, 1, expert(2).to_blob())  # replacing a held expert does not double count
    rt.unload_expert("m", 0, 0)
    assert rt.status()["memory_bytes"] == EXPERT_BYTES


def test_gates_are_counted_never_evicted_and_push_experts_out(tmp_path):
    gb = gate_blob(e=4)
    gbytes = 4 * H * 4
    rt = ExpertRuntime(memory_budget=2 * EXPERT_BYTES, disk_dir=tmp_path)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    rt.load_expert("m", 0, 1, expert(1).to_blob())
    assert rt.status()["evicted_to_disk"] == 0
    rt.load_gate("m", 0, gb)  # 2 experts + gate > budget: the LRU expert leaves memory
    assert tiers(rt) == {0: "disk", 1: "memory"}
    assert rt.status()["total_bytes"] == EXPERT_BYTES + gbytes
    assert rt.unload_gate("m", 0) and not rt.unload_gate("m", 0)
    with pytest.raises(GateNotLoaded):
        rt.gate("m", 0)


def test_expert_larger_than_the_budget_is_served_and_counted(tmp_path):
    rt = ExpertRuntime(memory_budget=EXPERT_BYTES // 2, disk_dir=tmp_path)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    assert rt.status()["admissions_over_budget"] == 1
    x = rows(1)
    np.testing.assert_array_equal(rt.execute("m", 0, 0, x, 1), expert_forward(expert(0), x))
    rt.load_expert("m", 0, 1, expert(1).to_blob())
    assert tiers(rt) == {0: "disk", 1: "memory"}
    assert rt.status()["admissions_over_budget"] == 2


def test_unload_removes_both_tiers_and_the_file(tmp_path):
    rt = ExpertRuntime(memory_budget=EXPERT_BYTES, disk_dir=tmp_path)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    rt.load_expert("m", 0, 1, expert(1).to_blob())
    assert rt.unload_expert("m", 0, 0) and not rt.unload_expert("m", 0, 0)
    assert not rt.disk.path("expert", "m", 0, 0).exists()
    assert [h["expert"] for h in rt.holdings()] == [1]
    assert ExpertRuntime(memory_budget=EXPERT_BYTES, disk_dir=tmp_path).holdings()[0]["expert"] == 1


def test_every_tier_change_notifies_listeners(tmp_path):
    rt = ExpertRuntime(memory_budget=EXPERT_BYTES, disk_dir=tmp_path)
    seen = []
    rt.add_listener(lambda: seen.append(tuple(h["residency"] for h in rt.holdings())))
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    rt.load_expert("m", 0, 1, expert(1).to_blob())  # evicts 0
    rt.execute("m", 0, 0, rows(1), 1)  # promotes 0, evicts 1
    rt.execute("m", 0, 0, rows(1), 1)  # memory hit: no change
    rt.unload_expert("m", 0, 1)
    assert seen == [("Warm",), ("Cold", "Warm"), ("Warm", "Cold"), ("Warm",)]


def test_default_budget_reads_env_and_rejects_garbage(monkeypatch):
    monkeypatch.setenv("TENZRO_MEMORY_BUDGET", "12345")
    assert default_memory_budget() == 12345
    monkeypatch.setenv("TENZRO_MEMORY_BUDGET", "lots")
    with pytest.raises(ValueError, match="TENZRO_MEMORY_BUDGET"):
        default_memory_budget()
    monkeypatch.delenv("TENZRO_MEMORY_BUDGET")
    import psutil
    assert 0 < default_memory_budget() <= psutil.virtual_memory().total
    monkeypatch.setattr(psutil, "virtual_memory", lambda: (_ for _ in ()).throw(OSError("no /proc")))
    assert default_memory_budget() == 4 << 30


# ---- metering -------------------------------------------------------------------------

def test_meter_rolls_over_a_minute_per_expert_and_host():
    clock = Clock()
    m = Meter(clock)
    m.record("a", 600)
    clock.t += 30
    m.record("b", 120)
    assert (m.tokens("a"), m.tokens("b"), m.tokens()) == (600, 120, 720)
    assert (m.tps("a"), m.tps()) == (10, 12)
    clock.t += 31
    assert (m.tokens("a"), m.tokens("b"), m.tokens()) == (0, 120, 120)
    clock.t += 60
    assert m.tps() == 0


def test_runtime_meters_served_tokens_but_not_disputes_or_self_tests(tmp_path):
    clock = Clock()
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path, clock=clock)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    rt.load_expert("m", 0, 1, expert(1).to_blob())
    rt.execute("m", 0, 0, rows(120), 120)
    rt.execute("m", 0, 1, rows(60), 60)
    rt.execute("m", 0, 1, rows(600), 600, metered=False)
    tps = {h["expert"]: h["committed_tps"] for h in rt.holdings()}
    assert tps == {0: 2, 1: 1}
    assert rt.status()["measured_tps"] == 3
    clock.t += 61
    assert rt.status()["measured_tps"] == 0


# ---- errors: clear, and nothing changes -----------------------------------------------

def test_bad_inputs_raise_clear_errors_and_change_nothing(tmp_path):
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    blob = expert(0).to_blob()
    rt.load_expert("m", 0, 0, blob)
    before = rt.status()
    with pytest.raises(DimensionMismatch, match="d_model") as e:
        rt.execute("m", 0, 0, rows(2, h=H + 1), 2, d_model=H + 1)
    assert e.value.field == "d_model"
    with pytest.raises(DimensionMismatch, match="token indices") as e:
        rt.execute("m", 0, 0, rows(3), 2)
    assert e.value.field == "token_indices"
    bad = rows(2)
    bad[1, 3] = np.nan
    with pytest.raises(NonFiniteInput):
        rt.execute("m", 0, 0, bad, 2)
    with pytest.raises(ExpertNotLoaded, match="l0/e9"):
        rt.execute("m", 0, 9, rows(1), 1)
    with pytest.raises(BadBlob, match="corrupt expert blob"):
        rt.load_expert("m", 0, 1, blob[:-10])
    with pytest.raises(BadBlob, match="hash mismatch") as e:
        rt.load_expert("m", 0, 1, blob, f"tenzro://blob/{'0' * 64}")
    assert e.value.field == "uri"
    with pytest.raises(BadBlob, match="corrupt gate blob"):
        rt.load_gate("m", 0, b"garbage")
    assert rt.status() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [rt.disk.path("expert", "m", 0, 0).name, rt.disk.path("expert", "m", 0, 0).with_suffix(".json").name])


# ---- the shared execution methods -----------------------------------------------------

def b64(a: np.ndarray) -> str:
    return wire.b64encode(wire.encode_f32(a))


def fetch_from(store: dict):
    def fetch(uri):
        return store[uri]
    return fetch


def test_methods_load_execute_route_status_unload(tmp_path):
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    blob = expert(3).to_blob()
    uri = f"tenzro://blob/{blob_hash(blob)}"
    row = methods.call(rt, "tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 3, "uri": uri},
                       fetch_from({uri: blob}))
    assert (row["tier"], row["source_uri"], row["d_model"], row["d_ff"]) == ("memory", uri, H, F)
    methods.call(rt, "tenzro_moeGateLoad", {"model_id": "m", "layer": 0,
                                            "blob_base64": base64.b64encode(gate_blob()).decode()}, None)
    x = rows(4)
    res = methods.call(rt, "tenzro_moeExecute", {"model_id": "m", "layer": 0, "expert": 3, "d_model": H,
                                                 "token_indices": [5, 1, 7, 2], "hidden_states": b64(x)}, None)
    assert res["token_indices"] == [5, 1, 7, 2]
    out = wire.decode_f32(wire.b64decode(res["outputs"], "outputs"), H)
    np.testing.assert_array_equal(out, expert_forward(expert(3), x))
    q8 = base64.b64encode(quant.quantize(x, "q8_0").tobytes()).decode()
    res = methods.call(rt, "tenzro_moeExecute", {"model_id": "m", "layer": 0, "expert": 3, "d_model": H,
                                                 "token_indices": [0, 1, 2, 3], "hidden_q8": q8}, None)
    xq = quant.dequantize(quant.quantize(x, "q8_0"), "q8_0", x.shape)
    np.testing.assert_array_equal(wire.decode_f32(wire.b64decode(res["outputs"], "o"), H), expert_forward(expert(3), xq))
    r = methods.call(rt, "tenzro_moeRoute", {"model_id": "m", "layer": 0, "d_model": H, "hidden_states": b64(x)}, None)
    assert r["top_k"] == 2 and r["tokens"] == 4 and len(r["routed"][0]["slots"]) == 2
    st = methods.call(rt, "tenzro_moeExpertStatus", {}, None)
    assert st["compute_backend"] == "cpu" and st["gpu"] is False and len(st["gates"]) == 1
    assert methods.call(rt, "tenzro_moeExpertUnload", {"model_id": "m", "layer": 0, "expert": 3}, None)["unloaded"]
    assert methods.call(rt, "tenzro_moeGateUnload", {"model_id": "m", "layer": 0}, None)["unloaded"]


def test_route_reads_ahead_the_selected_experts(tmp_path):
    rt = ExpertRuntime(memory_budget=EXPERT_BYTES + 4 * H * 4, disk_dir=tmp_path)
    rt.load_gate("m", 0, gate_blob())
    for e in range(4):
        rt.load_expert("m", 0, e, expert(e).to_blob())
    x = rows(1)
    r = methods.call(rt, "tenzro_moeRoute", {"model_id": "m", "layer": 0, "d_model": H, "hidden_states": b64(x),
                                             "top_k": 1}, None)
    chosen = r["routed"][0]["slots"][0]["expert"]
    assert tiers(rt)[chosen] == "memory"
    assert r["readahead"] == (0 if chosen == 3 else 1)


@pytest.mark.parametrize("params,code,field", [
    ({"d_model": H + 32, "hidden_states": None}, -32004, "d_model"),
    ({"token_indices": [0, 1, 2]}, -32602, "token_indices"),
    ({"hidden_states": "!!notbase64"}, -32602, "hidden_states"),
    ({"expert": 9}, -32004, "expert"),
    ({"hidden_states": None, "hidden_q8": "AAAA"}, -32602, "hidden_q8"),
    ({"token_indices": []}, -32602, "token_indices"),
    ({"purpose": "free"}, -32602, "purpose"),
])
def test_execute_method_errors_name_the_field(tmp_path, params, code, field):
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    p = {"model_id": "m", "layer": 0, "expert": 0, "d_model": H, "token_indices": [0, 1], "hidden_states": b64(rows(2))}
    p.update(params)
    if p["hidden_states"] is None:
        p["hidden_states"] = b64(rows(2, h=p["d_model"]))
        if "hidden_q8" in p:
            del p["hidden_states"]
    before = rt.status()
    with pytest.raises(RpcError) as e:
        methods.call(rt, "tenzro_moeExecute", p, None)
    assert (e.value.code, e.value.data["field"]) == (code, field), e.value.message
    assert rt.status() == before


def test_non_finite_rows_and_load_errors_via_methods(tmp_path):
    rt = ExpertRuntime(memory_budget=10 * EXPERT_BYTES, disk_dir=tmp_path)
    rt.load_expert("m", 0, 0, expert(0).to_blob())
    x = rows(1)
    x[0, 0] = np.inf
    with pytest.raises(RpcError, match="non-finite") as e:
        methods.call(rt, "tenzro_moeExecute", {"model_id": "m", "layer": 0, "expert": 0, "d_model": H,
                                               "token_indices": [0], "hidden_states": b64(x)}, None)
    assert e.value.data["field"] == "hidden_states"
    blob = expert(1).to_blob()
    wrong = f"tenzro://blob/{blob_hash(b'other')}"
    with pytest.raises(RpcError, match="hash mismatch"):
        methods.call(rt, "tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1, "uri": wrong},
                     fetch_from({wrong: blob}))
    with pytest.raises(RpcError, match="corrupt") as e:
        methods.call(rt, "tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1,
                                                  "blob_base64": base64.b64encode(b"not safetensors").decode()}, None)
    assert e.value.code == -32004
    with pytest.raises(RpcError, match="cannot fetch"):
        methods.call(rt, "tenzro_moeExpertLoad", {"model_id": "m", "layer": 0, "expert": 1, "uri": wrong},
                     fetch_from({}))
    with pytest.raises(RpcError, match="no gate") as e:
        methods.call(rt, "tenzro_moeRoute", {"model_id": "m", "layer": 0, "d_model": H, "hidden_states": b64(rows(1))},
                     None)
    assert e.value.code == -32004
    assert [h["expert"] for h in rt.holdings()] == [0]


# ---- the compute seam -----------------------------------------------------------------

@pytest.mark.parametrize("qtype,cols", [("q8_0", 96), ("q4_k", 512), ("q6_k", 768)])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_cpu_quantized_products_match_dequantized_gemm(qtype, cols, n):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, cols), dtype=np.float32)
    m = QuantizedMatrix(qtype, w.shape, quant.quantize(w, qtype))
    x = rng.standard_normal((n, cols), dtype=np.float32)
    ref = x @ m.dequantize().T
    y = CpuBackend(small_batch=16, native=False).matmul_xt(x, m)  # the numba path (tests/test_kernels.py: native)
    assert y.shape == (n, 24) and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_allclose(quantized_matmul_xt(x, m), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_parallel_dequantize_is_bit_identical_to_quant_dequantize(qtype):
    w = np.random.default_rng(4).standard_normal((12, 512), dtype=np.float32)
    w[0, :40] = 0.0
    w[1, :256] = 1e-7  # tiny scales: fp16 subnormals
    m = QuantizedMatrix(qtype, w.shape, quant.quantize(w, qtype))
    np.testing.assert_array_equal(dequantize_matrix(m).view(np.uint32), m.dequantize().view(np.uint32))


def test_quantized_expert_forward_through_the_seam():
    e = expert(4, h=256, f=256)
    q = ExpertWeights(*(QuantizedMatrix(k, m.shape, quant.quantize(m, k))
                        for k, m in zip(("q4_k", "q4_k", "q6_k"), (e.gate_proj, e.up_proj, e.down_proj))))
    assert q.quant == "q4_k" and q.d_model == 256
    deq = ExpertWeights(*(getattr(q, p).dequantize() for p in ("gate_proj", "up_proj", "down_proj")))
    x = rows(3, h=256)
    ref = expert_forward(deq, x)
    # With the native kernels the activation rows are quantized to 8 bits (ggml's contract): ~1e-3 relative.
    atol = (2e-2 if compute.backend().describe().get("native_kernels") else 1e-4) * np.abs(ref).max()
    np.testing.assert_allclose(expert_forward(q, x), ref, rtol=0, atol=atol)


def test_dense_seam_is_row_invariant_and_numpy_close():
    """The dense seam is ``moe.rowwise.matmul_xt`` (each row's bits independent of its batch,
    issue 21), within float rounding of numpy's ``x @ w.T``."""
    e, x = expert(2), rows(7)
    g, u = x @ e.gate_proj.T, x @ e.up_proj.T
    # The reference in float64: numpy's float32 product sums in its BLAS's order, which differs
    # by CPU (an AMD Zen 5 part 1.1e-7 from ours on a 0.008 output); ours is within f32 rounding.
    x64, (g64, u64, d64) = x.astype(np.float64), (m.astype(np.float64) for m in (e.gate_proj, e.up_proj, e.down_proj))
    gg, uu = x64 @ g64.T, x64 @ u64.T
    ref = (gg / (1 + np.exp(-gg)) * uu) @ d64.T
    np.testing.assert_array_equal(compute.backend().matmul_xt(x, e.gate_proj), rowwise.matmul_xt(x, e.gate_proj))
    np.testing.assert_array_equal(compute.backend().matmul_xt(x[:1], e.gate_proj),
                                  compute.backend().matmul_xt(x, e.gate_proj)[:1])
    np.testing.assert_allclose(compute.backend().matmul_xt(x, e.gate_proj), g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(expert_forward(e, x), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_quantized_matrix_and_expert_shape_errors():
    with pytest.raises(ValueError, match="needs 136 bytes"):
        QuantizedMatrix("q8_0", (2, 64), np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="unsupported quantization"):
        QuantizedMatrix("q5_k", (2, 256), np.zeros(10, np.uint8))
    m = QuantizedMatrix("q8_0", (F, 96), np.zeros(F * 3 * 34, np.uint8))
    with pytest.raises(ValueError, match="up_proj"):
        ExpertWeights(expert(0).gate_proj, m, expert(0).down_proj)


def test_backend_selection():
    assert compute.select_backend("cpu").tag == "cpu"
    assert compute.select_backend("auto").tag in ("cpu", "cuda", "wgpu")
    if compute.select_backend("auto").tag == "wgpu":
        assert compute.select_backend("auto").gpu  # auto never takes a CPU-emulated adapter
    with pytest.raises(ValueError, match="unknown compute backend"):
        compute.select_backend("tpu")


HAS_CUPY = importlib.util.find_spec("cupy") is not None


def _unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot start here (package present but no device), or None."""
    try:
        compute.make_backend(name)
    except compute.BackendUnavailable as exc:
        return f"{name} backend unavailable: {exc}"
    return None


CUDA_SKIP = ("CuPy is not installed (optional extra [cuda]); no CUDA backend here" if not HAS_CUPY
             else _unavailable("cuda"))


@pytest.mark.skipif(CUDA_SKIP is not None, reason=CUDA_SKIP or "")
def test_cuda_backend_keeps_weights_resident_and_matches_cpu():
    b = compute.make_backend("cuda")
    e, x = expert(1), rows(9)
    np.testing.assert_allclose(b.matmul_xt(x, e.gate_proj), x @ e.gate_proj.T, rtol=1e-4, atol=1e-5)
    resident = b.describe()["resident_bytes"]
    b.matmul_xt(x, e.gate_proj)
    assert b.describe()["resident_bytes"] == resident  # no second upload
    b.release(e.gate_proj)
    assert b.describe()["resident_bytes"] == resident - e.gate_proj.nbytes


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed; the missing-package path is not reachable")
def test_cuda_backend_explains_why_it_is_unavailable():
    with pytest.raises(compute.BackendUnavailable, match="CuPy is not importable"):
        compute.select_backend("cuda")


HAS_WGPU = importlib.util.find_spec("wgpu") is not None
# Package present but no adapter (no Vulkan ICD) is a reason to skip too, decided at collection.
WGPU_SKIP = ("wgpu-py is not installed (optional extra [wgpu]); no WebGPU backend here" if not HAS_WGPU
             else _unavailable("wgpu"))


@pytest.fixture
def wgpu_backend():
    return compute.make_backend("wgpu")


@pytest.mark.skipif(WGPU_SKIP is not None, reason=WGPU_SKIP or "")
def test_wgpu_backend_matches_numpy_and_keeps_weights_resident(wgpu_backend):
    b = wgpu_backend
    rng = np.random.default_rng(6)
    for n, k, o in ((1, 64, 5), (19, 100, 37), (40, 512, 48)):
        x = rng.standard_normal((n, k), dtype=np.float32)
        w = rng.standard_normal((o, k), dtype=np.float32)
        ref = x @ w.T
        np.testing.assert_allclose(b.matmul_xt(x, w), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        resident = b.describe()["resident_bytes"]
        b.matmul_xt(x, w)
        assert b.describe()["resident_bytes"] == resident  # no second upload
        b.release(w)
        assert b.describe()["resident_bytes"] == resident - w.nbytes
    m = QuantizedMatrix("q4_k", (24, 256), quant.quantize(rng.standard_normal((24, 256), dtype=np.float32), "q4_k"))
    x = rng.standard_normal((3, 256), dtype=np.float32)
    ref = x @ m.dequantize().T
    np.testing.assert_allclose(b.matmul_xt(x, m), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert b.describe()["gpu"] == (b.adapter_type.upper() != "CPU")


@pytest.mark.skipif(WGPU_SKIP is not None, reason=WGPU_SKIP or "")
def test_runtime_reports_the_wgpu_backend_and_serves_through_it(tmp_path, wgpu_backend):
    rt = ExpertRuntime(memory_budget=EXPERT_BYTES, disk_dir=tmp_path, backend=wgpu_backend)
    previous = compute.backend()
    compute.set_backend(wgpu_backend)
    try:
        rt.load_expert("m", 0, 0, expert(0).to_blob())
        x = rows(5)
        out = rt.execute("m", 0, 0, x, 5)
        rt.load_expert("m", 0, 1, expert(1).to_blob())  # evicts 0: its device copies are released
        assert wgpu_backend.describe()["resident_bytes"] == 0
    finally:
        compute.set_backend(previous)
    ref = expert_forward(expert(0), x)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    st = rt.status()
    assert st["compute_backend"] == "wgpu" and st["gpu"] == wgpu_backend.gpu
