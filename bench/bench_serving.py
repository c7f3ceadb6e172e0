"""The OpenAI endpoints under many clients, measured by a third-party load generator (aiperf),
beside the same model in one process and llama.cpp's own server.

Usage:  .venv/bin/python bench/bench_serving.py [--concurrency 1,4,16,64] [--requests-per-client 2]
        [--prompt 32] [--tokens 24] [--holders 3] [--endpoint completions|chat] [--models fixture,slice]
        [--modes distributed,in-process,llama-server] [--pool 8] [--request-timeout 120] [--cpus 0-1]
        [--aiperf PATH] [--llama-server PATH] [--artifacts DIR] [--json]

Load generator: NVIDIA's ``aiperf`` (PyPI ``aiperf==0.13.0``, ``requirements-bench.txt``), run as
a separate program from its own virtual environment (``make bench`` creates ``.venv-bench``):
it pins ``prometheus-client~=0.23`` against the site's 0.21 and pulls ~80 packages (pandas,
transformers, dash …) the site and its tests do not need. It runs offline: the tokenizer is a
local directory (no Hub lookup for a path), and the bench points ``HTTP(S)_PROXY`` at a closed
port (only 127.0.0.1 is exempt), so any attempt to reach the network fails the run.

Models (``--models``), each with a byte-level ``tokenizer.json`` written here (``tokenizers``:
token id = byte value, no merges, 256 entries, so every id is in the model's vocabulary; aiperf
sends text, makes its synthetic prompts with the same tokenizer, exactly ``--prompt`` tokens,
and counts output tokens from the server's ``usage``, ``--use-server-token-count``):

* ``fixture``: the shipped qwen3-MoE fixture (``tests/fixtures/qwen3_moe_tiny``, vocab 256),
  published from its directory;
* ``slice``: the Qwen3-30B-A3B-shaped slice of ``bench_generate.py`` (``Model("synth")``: 2
  layers of 128 Q4_K_M experts, top-8, H 2048, expert FFN 768, 32/4 heads of 128; ``--pool``
  distinct quantized matrices; vocab 256 here), written as one GGUF file
  (``prepare.gguf_export.write_gguf``, ~0.9 GB): real per-step expert compute.

Requests: ``/v1/completions`` (or chat), streamed, ``temperature`` 0, ``max_tokens`` ``--tokens``
(the models have no EOS: every request gets them all).

Three modes, same workload, same cores (the site, its agents, llama-server and aiperf are
pinned to ``--cpus``): ``distributed``, a fresh ``tenzro_cluster`` of ``--holders`` agents
(replication 2) holding every expert; ``in-process``, a fresh cluster whose site also loads
every expert into its own runtime (``tenzro_moeExpertLoad`` without a provider), so each MoE
layer runs in the site process (transport "local") and no batch leaves it; ``llama-server``,
llama.cpp's own server (``make .venv-bench/bin/llama-server`` builds it from the vendored
llama.cpp of the pinned llama-cpp-python sdist) on a GGUF of the same weights (the fixture:
``manage.py export_gguf`` from the distributed cluster's site; the slice: the very file the
cluster published), one slot per client, ``ignore_eos``. Per model, mode and concurrency C:
aiperf sends ``C * --requests-per-client`` requests keeping C in flight, after one warm-up
request per mode. Reported: output tokens/s, TTFT and inter-token latency p50/p99 (ms),
errors, tokens/s relative to C=1 of the same mode, distributed ÷ in-process, then issue 21's
goals each with its value and met / MISSED. ``cpu``: the CPU model and the SIMD path of the
quantized kernels.

Per site run it also prints what the site's own ``/metrics`` said (aiperf scrapes it during
the run): holder batches, the worst per-holder p99 and failed batches. Prints a table per
model, and with ``--json`` one JSON object last. aiperf's own artifacts (per-request records,
its scrape of ``/metrics``) are kept under ``--artifacts`` when given. Exits non-zero, naming
what failed, when a run did not finish or any request to the site failed (llama-server's own
failed requests are listed, not fatal: it is the anchor, not the system measured; a missed speed goal is
reported, not fatal: the machine may be shared); a mode whose executable is missing is skipped
and said so.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")

import httpx  # noqa: E402

from machine import cpu_model, int_at_least, int_list, parse_cpus  # noqa: E402
from tests.cluster_util import env_for, rpc, running_cluster  # noqa: E402
from tests.conftest import QWEN  # noqa: E402

MODEL = "qwen3-moe-tiny"
SLICE = "qwen3-30b-a3b-slice"
MODES = ("distributed", "in-process", "llama-server")
OURS = ("distributed", "in-process")  # the modes whose request errors fail the bench (llama-server is the anchor)
MODELS = ("fixture", "slice")
CHAT_OVERHEAD = 16  # bytes the plain chat rendering ("user: …\nassistant:") adds to a prompt, rounded up


def byte_tokenizer_json() -> str:
    """A byte-level ``tokenizers`` tokenizer whose token id is the byte value (256 ids, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for bytes, the alphabet ByteLevel pre-tokenization maps bytes to.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


@dataclass(frozen=True)
class BenchModel:
    """One served model of the bench: ``key`` (``--models``), ``model_id``, ``checkpoint`` (a
    directory or a ``.gguf`` file the cluster publishes), ``tokenizer`` (a directory with the
    byte-level ``tokenizer.json`` aiperf reads), ``context`` (positions), ``gguf`` (the file
    llama-server loads; None: exported from the distributed cluster's site, ``export_gguf``)."""

    key: str
    model_id: str
    checkpoint: Path
    tokenizer: Path
    context: int
    gguf: Path | None = None


def write_tokenizer(out: Path, context: int) -> None:
    """The byte-level ``tokenizer.json`` and the ``tokenizer_config.json`` aiperf's
    transformers ``AutoTokenizer`` wants (the class named), in ``out``."""
    (out / "tokenizer.json").write_text(byte_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "model_max_length": context}))


def fixture_model(tmp: Path) -> BenchModel:
    """The qwen3 fixture's config and weights plus the byte-level tokenizer, in ``tmp/fixture``."""
    out = tmp / "fixture"
    out.mkdir()
    config = json.loads((QWEN / "config.json").read_text())
    if config["vocab_size"] < 256:
        raise SystemExit(f"{QWEN}: vocab_size {config['vocab_size']} < 256, too small for a byte tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(QWEN / name, out / name)
    write_tokenizer(out, config["max_position_embeddings"])
    return BenchModel("fixture", MODEL, out, out, config["max_position_embeddings"])


def slice_model(tmp: Path, pool: int) -> BenchModel:
    """The Qwen3-30B-A3B-shaped slice of ``bench_generate`` (2 layers of 128 Q4_K_M experts,
    top-8, H 2048, expert FFN 768; ``pool`` distinct quantized matrices) with a 256-id
    vocabulary, written as one GGUF file (``prepare.gguf_export``) with the byte-level
    tokenizer: the cluster publishes that file and llama-server loads the same one."""
    from bench_generate import Model
    from prepare.gguf_export import ExportModel, write_gguf

    out = tmp / "slice"
    out.mkdir()
    m = Model("synth", pool, 256)
    config = {**m.config, "architectures": ["Qwen3MoeForCausalLM"], "bos_token_id": None, "eos_token_id": None}
    gguf = out / f"{SLICE}.gguf"
    write_tokenizer(out, config["max_position_embeddings"])
    write_gguf(ExportModel(config=config, backbone={n: ("F32", a) for n, a in m.weights.items()}, gates=m.gates,
                           expert=lambda layer, e: (m.experts[layer][e], "f32"),
                           tokenizer_json=(out / "tokenizer.json").read_text()), gguf)
    return BenchModel("slice", SLICE, gguf, out, config["max_position_embeddings"], gguf)


def load_experts_on_site(url: str, token: str, model_id: str) -> int:
    """Load every published expert of ``model_id`` into the site's own runtime; returns how many."""
    holdings = httpx.get(f"{url}/api/v1/holdings", params={"model_id": model_id}, timeout=60).json()["holdings"]
    uris = {(h["layer"], h["expert"]): h["blob_uri"] for h in holdings}
    for (layer, expert), uri in sorted(uris.items()):
        r = rpc(f"{url}/rpc", "tenzro_moeExpertLoad", {"model_id": model_id, "layer": layer, "expert": expert,
                                                       "uri": uri}, token=token)
        if "error" in r:
            raise SystemExit(f"loading expert {layer}/{expert} on the site failed: {r['error']}")
    return len(uris)


def warm_up(url: str, model_id: str, tokens: int) -> None:
    """One request through the whole path (gates, backbone, expert caches) before measuring."""
    r = httpx.post(f"{url}/v1/completions", json={"model": model_id, "prompt": "warm up the serving path",
                                                  "max_tokens": tokens, "temperature": 0}, timeout=600)
    r.raise_for_status()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_llama_server(given: str | None) -> str | None:
    """``--llama-server``, else ``$TENZRO_LLAMA_SERVER``, else ``.venv-bench/bin/llama-server`` (``make
    .venv-bench/bin/llama-server`` builds it), else ``llama-server`` on PATH; None when none is there."""
    for cand in (given, os.environ.get("TENZRO_LLAMA_SERVER"), str(ROOT / ".venv-bench" / "bin" / "llama-server"),
                 shutil.which("llama-server")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


@contextmanager
def llama_server(binary: str, gguf: Path, model_id: str, slots: int, slot_context: int, threads: int, log: Path,
                 timeout: float = 600.0):
    """llama.cpp's own server on ``gguf`` (127.0.0.1, a free port, served as ``model_id``), with
    ``slots`` parallel sequences of ``slot_context`` positions each (its continuous batching),
    ``threads`` compute threads; yields its URL once ``/health`` answers 200, stops it after.
    Raises ``RunFailed`` when it exits or is not ready within ``timeout`` s."""
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", model_id,
           "--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--threads", str(threads),
           "--threads-batch", str(threads), "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RunFailed(f"llama-server exited with {proc.returncode} before it was ready (log {log})")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RunFailed(f"llama-server not ready after {timeout:.0f} s (log {log})")
            time.sleep(0.5)
        yield url
    finally:
        stop_group(proc)


def export_gguf(run_dir: Path, model_id: str, out: Path) -> Path:
    """``manage.py export_gguf`` of ``model_id`` from the cluster whose state is in ``run_dir``
    (its database and blob store: ``env_for(run_dir)``); raises ``RunFailed`` with its message."""
    r = subprocess.run([sys.executable, str(ROOT / "manage.py"), "export_gguf", "--model-id", model_id, "--out",
                        str(out)], cwd=ROOT, env=env_for(run_dir), capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not out.exists():
        raise RunFailed(f"export_gguf --model-id {model_id} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return out


class RunFailed(Exception):
    """One aiperf run did not finish (it failed, or the site stopped answering)."""


def run_aiperf(aiperf: str, url: str, model_id: str, tokenizer: Path, concurrency: int, requests: int, prompt: int,
               tokens: int, out: Path, endpoint: str = "completions", request_timeout: float = 120.0,
               startup_s: float = 120.0, extra_inputs: tuple[str, ...] = ()) -> tuple[dict, dict | None]:
    """One aiperf profile; returns its ``profile_export_aiperf.json`` and its scrape of the site's
    ``/metrics`` (None when absent). A request unanswered after ``request_timeout`` s is an
    error; aiperf still running ``startup_s`` after every round of requests could have timed
    out is killed (its whole process group: it forks services). ``extra_inputs``: more
    ``name:value`` request fields. Raises ``RunFailed``."""
    cmd = [aiperf, "profile", "--model", model_id, "--url", url, "--endpoint-type", endpoint, "--streaming",
           "--tokenizer", str(tokenizer), "--use-server-token-count",
           "--synthetic-input-tokens-mean", str(prompt), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(tokens), "--output-tokens-stddev", "0", "--extra-inputs", "temperature:0",
           "--concurrency", str(concurrency), "--request-count", str(requests), "--random-seed", "1",
           "--artifact-dir", str(out), "--ui-type", "none", "--no-gpu-telemetry",
           "--request-timeout-seconds", f"{request_timeout:g}"]
    for extra in extra_inputs:
        cmd += ["--extra-inputs", extra]
    # Offline by construction: anything but loopback goes to a closed port and fails.
    env = {**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
    limit = request_timeout * -(-requests // concurrency) + startup_s
    with open(out.parent / f"{out.name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None or rc is None:
                stop_group(proc)
    export = out / "profile_export_aiperf.json"
    if rc is None:
        raise RunFailed(f"aiperf still running after {limit:.0f} s: the site stopped answering")
    if rc != 0 or not export.exists():
        errors = [ln for ln in (out.parent / f"{out.name}.log").read_text(errors="replace").splitlines()
                  if " ERROR " in ln]
        raise RunFailed(f"aiperf exited with {rc}: {errors[-1].strip() if errors else 'no error logged'} "
                        f"(log {out.parent / out.name}.log)")
    server = out / "server_metrics_export.json"
    return json.loads(export.read_text()), json.loads(server.read_text()) if server.exists() else None


def holder_stats(server: dict | None) -> dict:
    """Per provider ``{batches, p50_ms, p99_ms, failures}`` from aiperf's scrape of the site's
    ``/metrics`` during the run (``server_metrics_export.json``; "local": experts the site ran)."""
    metrics = (server or {}).get("metrics") or {}
    out: dict[str, dict] = {}
    for s in (metrics.get("tenzro_holder_batch_seconds") or {}).get("series", []):
        st = s.get("stats") or {}
        p50, p99 = st.get("p50_estimate"), st.get("p99_estimate")
        out[s["labels"]["provider"][:12]] = {"batches": int(st.get("count") or 0), "failures": 0,
                                             "p50_ms": None if p50 is None else round(p50 * 1e3, 1),
                                             "p99_ms": None if p99 is None else round(p99 * 1e3, 1)}
    failures = metrics.get("tenzro_holder_batch_failures") or metrics.get("tenzro_holder_batch_failures_total") or {}
    for s in failures.get("series", []):
        row = out.setdefault(s["labels"]["provider"][:12], {"batches": 0, "p50_ms": None, "p99_ms": None})
        row["failures"] = int((s.get("stats") or {}).get("total") or 0)  # increase during the run
    return out


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it 10 s later if anything still runs."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            if sig == signal.SIGTERM:
                time.sleep(1)  # its forked services leave after the controller
        except subprocess.TimeoutExpired:
            pass


def summarize(report: dict, concurrency: int, server: dict | None = None) -> dict:
    """The numbers this bench reports from one aiperf export (and its scrape of ``/metrics``)."""
    def stat(name: str, key: str) -> float | None:
        v = (report.get(name) or {}).get(key)
        return None if v is None else round(float(v), 2)

    summary = report.get("error_summary") or []
    errors = sum(int(e.get("count", 1)) for e in summary)
    kinds = sorted({(e.get("error_details") or {}).get("type") or "?" for e in summary})
    return {"concurrency": concurrency, "requests": int(stat("request_count", "avg") or 0), "errors": errors,
            "error_types": kinds,
            "tokens_per_s": stat("output_token_throughput", "avg"),
            "ttft_ms": {"p50": stat("time_to_first_token", "p50"), "p99": stat("time_to_first_token", "p99")},
            "itl_ms": {"p50": stat("inter_token_latency", "p50"), "p99": stat("inter_token_latency", "p99")},
            "holders": holder_stats(server)}


def cpu_description() -> str:
    """CPU model (``/proc/cpuinfo``) and the SIMD path of the quantized kernels."""
    from moe import kernels

    return f"{cpu_model()}; quantized kernels: {kernels.isa() or 'numba (no native extension)'}"


def find_aiperf(given: str | None) -> str:
    """``--aiperf``, else ``$TENZRO_AIPERF``, else ``.venv-bench/bin/aiperf``, else ``aiperf`` on PATH."""
    for cand in (given, os.environ.get("TENZRO_AIPERF"), str(ROOT / ".venv-bench" / "bin" / "aiperf"),
                 shutil.which("aiperf")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise SystemExit("aiperf not found: `make bench` installs it into .venv-bench (requirements-bench.txt), or "
                     "pass --aiperf PATH")


def table(results: dict[str, list[dict]]) -> list[str]:
    """Rows per concurrency: each mode's numbers, its scaling over C=1, and distributed ÷ in-process."""
    head = f"{'mode':<12}{'C':>4}{'reqs':>6}{'err':>5}{'tok/s':>9}{'×C=1':>7}{'TTFT p50':>10}{'p99':>9}" \
           f"{'ITL p50':>9}{'p99':>9}{'p99/p50':>8}{'dist÷in':>9}"
    lines = [head, "-" * len(head)]
    base = {m: rows[0]["tokens_per_s"] for m, rows in results.items() if rows}
    inproc = {r["concurrency"]: r["tokens_per_s"] for r in results.get("in-process", [])}

    def f(v, nd=1):
        return "–" if v is None else f"{v:.{nd}f}"

    for mode, rows in results.items():
        for r in rows:
            scale = r["tokens_per_s"] / base[mode] if base.get(mode) and r["tokens_per_s"] else None
            itl = r["itl_ms"]
            tail = itl["p99"] / itl["p50"] if itl["p50"] and itl["p99"] else None
            ratio = r["tokens_per_s"] / inproc[r["concurrency"]] \
                if mode == "distributed" and inproc.get(r["concurrency"]) and r["tokens_per_s"] else None
            lines.append(f"{mode:<12}{r['concurrency']:>4}{r['requests']:>6}{r['errors']:>5}{f(r['tokens_per_s']):>9}"
                         f"{f(scale, 2):>7}{f(r['ttft_ms']['p50'], 0):>10}{f(r['ttft_ms']['p99'], 0):>9}"
                         f"{f(itl['p50'], 0):>9}{f(itl['p99'], 0):>9}{f(tail, 2):>8}{f(ratio, 2):>9}")
    return lines


def mode_list(text: str) -> list[str]:
    """An argparse ``type``: a comma list of ``MODES``, returned in ``MODES`` order (in-process
    loads the experts into the site, so it runs last)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(MODES)}, got {text!r}")
    return sorted(set(modes), key=MODES.index)


def model_list(text: str) -> list[str]:
    """An argparse ``type``: a comma list of ``MODELS``, returned in ``MODELS`` order."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(MODELS)}, got {text!r}")
    return sorted(set(models), key=MODELS.index)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, start the cluster, run aiperf per mode and concurrency, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int_list(1), default=[1, 4, 16, 64], help="clients in flight (1,4,16,64)")
    ap.add_argument("--requests-per-client", type=int_at_least(1), default=2,
                    help="requests per concurrency level = C × this (default 2)")
    ap.add_argument("--prompt", type=int_at_least(1), default=32, help="prompt tokens per request (default 32)")
    ap.add_argument("--tokens", type=int_at_least(1), default=24, help="output tokens per request (default 24)")
    ap.add_argument("--holders", type=int_at_least(1), default=3, help="holder agents (default 3)")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                    help="/v1/completions (default) or /v1/chat/completions (the plain chat rendering adds "
                         "its role prefix to each prompt)")
    ap.add_argument("--request-timeout", type=int_at_least(1), default=120,
                    help="seconds before aiperf counts an unanswered request as an error (default 120)")
    ap.add_argument("--modes", type=mode_list, default=list(MODES),
                    help="comma list of distributed, in-process, llama-server (default all)")
    ap.add_argument("--models", type=model_list, default=list(MODELS),
                    help="comma list of fixture (the shipped qwen3 fixture), slice (the Qwen3-30B-A3B-shaped "
                         "slice) (default both)")
    ap.add_argument("--pool", type=int_at_least(1), default=8,
                    help="distinct Q4_K_M matrices of the slice's experts (bench_generate --pool; default 8)")
    ap.add_argument("--cpus", default=None, help="CPU set of the site, its agents, llama-server and aiperf "
                                                 "(default: this process's affinity), e.g. 0-1")
    ap.add_argument("--aiperf", default=None, help="aiperf executable (default: $TENZRO_AIPERF, "
                                                   ".venv-bench/bin/aiperf, PATH)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp server executable (default: "
                                                         "$TENZRO_LLAMA_SERVER, .venv-bench/bin/llama-server, PATH)")
    ap.add_argument("--artifacts", default=None, help="keep aiperf's artifacts in this directory")
    ap.add_argument("--json", action="store_true", help="also print one JSON object")
    a = ap.parse_args(argv)
    ctx = json.loads((QWEN / "config.json").read_text())["max_position_embeddings"]
    chat = CHAT_OVERHEAD if a.endpoint == "chat" else 0
    if "fixture" in a.models and a.prompt + a.tokens > ctx - chat:
        ap.error(f"argument --tokens: --prompt + --tokens is {a.prompt + a.tokens}, over the fixture's context "
                 f"of {ctx} positions" + (f" less {chat} for the chat rendering" if chat else ""))
    try:
        cpus = parse_cpus(a.cpus)
    except ValueError as exc:
        ap.error(str(exc))
    aiperf = find_aiperf(a.aiperf)
    server_bin = find_llama_server(a.llama_server) if "llama-server" in a.modes else None
    os.sched_setaffinity(0, cpus)  # inherited by the cluster, its agents, llama-server and aiperf

    results: dict[str, dict[str, list[dict]]] = {}
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as t:
        tmp = Path(t)
        arts = Path(a.artifacts) if a.artifacts else tmp / "aiperf"
        arts.mkdir(parents=True, exist_ok=True)
        for key in a.models:
            started = time.perf_counter()
            model = fixture_model(tmp) if key == "fixture" else slice_model(tmp, a.pool)
            print(f"{key}: {model.model_id} from {model.checkpoint.name} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
            results[key] = {}
            gguf = model.gguf

            def levels(mode: str, url: str, extra: tuple[str, ...] = (), key: str = key,
                       model: BenchModel = model) -> None:
                results[key][mode] = []
                for c in a.concurrency:
                    try:
                        report, server = run_aiperf(aiperf, url, model.model_id, model.tokenizer, c,
                                                    c * a.requests_per_client, a.prompt, a.tokens,
                                                    arts / f"{key}-{mode}-c{c}", a.endpoint, a.request_timeout,
                                                    extra_inputs=extra)
                    except RunFailed as exc:  # the server is likely wedged: the mode's higher C would be too
                        print(f"{key} {mode} C={c}: FAILED: {exc}", flush=True)
                        failed[f"{key} {mode}"] = f"C={c}: {str(exc).splitlines()[0]}"
                        return
                    row = summarize(report, c, server)
                    results[key][mode].append(row)
                    hs = row["holders"].values()
                    print(f"{key} {mode} C={c}: {row['tokens_per_s']} tok/s, TTFT p50 {row['ttft_ms']['p50']} ms, "
                          f"ITL p50 {row['itl_ms']['p50']} ms, {row['errors']} errors"
                          + (f"; holder batches {sum(h['batches'] for h in hs)}, worst p99 "
                             f"{max((h['p99_ms'] or 0 for h in hs), default=0)} ms, "
                             f"{sum(h['failures'] for h in hs)} failed (site /metrics)" if hs else ""), flush=True)

            for mode in a.modes:
                if mode == "llama-server":
                    if server_bin is None:
                        skipped[f"{key} llama-server"] = ("no llama-server executable (`make .venv-bench/bin/llama-"
                                                          "server` builds it; or --llama-server PATH)")
                        continue
                    if gguf is None:
                        skipped[f"{key} llama-server"] = "no GGUF: run the distributed or in-process mode too"
                        continue
                    try:
                        with llama_server(server_bin, gguf, model.model_id, max(a.concurrency),
                                          a.prompt + a.tokens + chat + 16, len(cpus),
                                          tmp / f"{key}-llama-server.log") as url:
                            print(f"{key} llama-server: {server_bin} on {gguf.name} at {url}", flush=True)
                            warm_up(url, model.model_id, a.tokens)
                            # The fixtures have no EOS, but llama.cpp's vocabulary names one: every
                            # request gets its --tokens, as on the site.
                            levels(mode, url, ("ignore_eos:true",))
                    except (RunFailed, httpx.HTTPError) as exc:
                        print(f"{key} llama-server: FAILED: {exc}", flush=True)
                        failed[f"{key} llama-server"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    continue
                # A fresh cluster per mode: nothing one mode left running (threads of finished or
                # cancelled generations, background recording) lands on the other's numbers.
                run_dir = tmp / f"{key}-{mode}"
                run_dir.mkdir()
                try:
                    gguf = site_mode(mode, run_dir, model, gguf, levels, a, aiperf, cpus,
                                     export=server_bin is not None and "llama-server" in a.modes, failed=failed)
                except (AssertionError, RunFailed, httpx.HTTPError) as exc:  # the cluster did not start or answer
                    print(f"{key} {mode}: FAILED: {str(exc).splitlines()[0]}", flush=True)
                    failed[f"{key} {mode}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    print()
    print(f"cpu: {cpu_description()}; CPUs {cpus} shared by the site, {a.holders} agents, llama-server and aiperf")
    path = "/v1/chat/completions" if a.endpoint == "chat" else "/v1/completions"
    print(f"workload: {path} streamed, greedy, {a.prompt} prompt + {a.tokens} output tokens, "
          f"{a.requests_per_client} requests per client (byte-level tokenizer)")
    for key, res in results.items():
        print(f"\nmodel {key} ({MODEL if key == 'fixture' else SLICE})")
        for line in table(res):
            print(line)
    print()
    goal_lines = goals(results)
    for line in goal_lines:
        print(line)
    for what, why in skipped.items():
        print(f"{what}: skipped: {why}")
    for what, why in failed.items():
        print(f"{what}: FAILED: {why}")
    errors = sum(r["errors"] for res in results.values() for mode, rows in res.items() if mode in OURS for r in rows)
    for key, res in results.items():  # the anchor's own failures are reported, not ours to fail on
        for r in res.get("llama-server", []):
            if r["errors"]:
                kinds = r.get("error_types") or []
                why = ("; InvalidInferenceResultError: a stream that carried no text"
                       if "InvalidInferenceResultError" in kinds else "")
                print(f"{key} llama-server C={r['concurrency']}: {r['errors']} request(s) failed in llama-server "
                      f"({', '.join(kinds)}{why})")
    if a.json:
        print(json.dumps({"cpu": cpu_description(), "cpus": cpus, "holders": a.holders, "endpoint": a.endpoint,
                          "prompt": a.prompt, "tokens": a.tokens, "requests_per_client": a.requests_per_client,
                          "results": results, "goals": goal_lines, "failed": failed, "skipped": skipped}))
    if failed or errors:
        raise SystemExit(f"bench_serving FAILED: {len(failed)} run(s) did not finish, {errors} request error(s) "
                         f"(above)")


def site_mode(mode: str, run_dir: Path, model: BenchModel, gguf: Path | None, levels, a, aiperf: str,
              cpus: list[int], export: bool, failed: dict) -> Path | None:
    """One site mode (``distributed`` or ``in-process``) of ``model`` on a fresh cluster in
    ``run_dir``: start it, export the GGUF llama-server needs when ``export`` and ``gguf`` is
    None, load the experts into the site for ``in-process``, warm up, run ``levels(mode, url)``;
    returns the GGUF (``gguf`` or the export). Raises ``AssertionError`` (the cluster did not
    start), ``RunFailed`` or ``httpx.HTTPError`` (the warm-up failed)."""
    key = model.key
    started = time.perf_counter()
    with running_cluster(run_dir, [model.checkpoint], holders=a.holders, env=env_for(run_dir),
                         timeout=1800, extra=("--model-id", model.model_id)) as (info, _proc):
        print(f"{key} {mode}: cluster of {a.holders} holders up in {time.perf_counter() - started:.0f} s "
              f"at {info['url']}; aiperf {aiperf}; CPUs {cpus}", flush=True)
        if gguf is None and export:
            try:
                gguf = export_gguf(run_dir, model.model_id, run_dir.parent / f"{key}.gguf")
            except RunFailed as exc:
                failed[f"{key} export_gguf"] = str(exc)
        if mode == "in-process":
            n = load_experts_on_site(info["url"], info["operator_token"], model.model_id)
            print(f"{key} in-process: {n} experts loaded into the site's runtime", flush=True)
        warm_up(info["url"], model.model_id, a.tokens)
        levels(mode, info["url"])
    return gguf


def goals(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Issue 21's goals, each with its measured value and met / MISSED: per model, the
    distributed C=16 ÷ C=1 tokens/s (≥ 6 on the fixture, ≥ 3 on the slice), C=64 ≥ C=16,
    distributed ÷ in-process at C=16 ≥ 0.8, ITL p99 ÷ p50 at C=16 ≤ 2.5, and 0 errors."""
    out = []

    def line(what: str, value: float | None, ok: bool) -> None:
        out.append(f"goal {what}: {'–' if value is None else f'{value:.2f}'} "
                   f"{'met' if value is not None and ok else 'MISSED'}")

    for key, res in results.items():
        dist = {r["concurrency"]: r for r in res.get("distributed", [])}
        inproc = {r["concurrency"]: r for r in res.get("in-process", [])}

        def tps(rows: dict, c: int) -> float | None:
            return (rows.get(c) or {}).get("tokens_per_s")

        want = 6.0 if key == "fixture" else 3.0
        d1, d16, d64, i16 = tps(dist, 1), tps(dist, 16), tps(dist, 64), tps(inproc, 16)
        if d1 and d16:
            v = d16 / d1
            line(f"{key}: distributed C=16 / C=1 >= {want:g}", v, v >= want)
        if d16 and d64:
            v = d64 / d16
            line(f"{key}: distributed C=64 / C=16 >= 1", v, v >= 1)
        if d16 and i16:
            v = d16 / i16
            line(f"{key}: distributed / in-process at C=16 >= 0.8", v, v >= 0.8)
        itl = (dist.get(16) or {}).get("itl_ms") or {}
        if itl.get("p50") and itl.get("p99"):
            v = itl["p99"] / itl["p50"]
            line(f"{key}: distributed ITL p99 / p50 at C=16 <= 2.5", v, v <= 2.5)
        n = sum(r["errors"] for mode, rows in res.items() if mode in OURS for r in rows)
        line(f"{key}: errors == 0 (distributed, in-process)", float(n), n == 0)
    return out


if __name__ == "__main__":
    main()
