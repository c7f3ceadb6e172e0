"""The OpenAI endpoints under many clients, measured by a third-party load generator (aiperf).

Usage:  .venv/bin/python bench/bench_serving.py [--concurrency 1,4,16,64] [--requests-per-client 2]
        [--prompt 32] [--tokens 24] [--holders 3] [--endpoint completions|chat]
        [--modes distributed,in-process] [--request-timeout 120] [--cpus 0-1] [--aiperf PATH] [--artifacts DIR] [--json]

Load generator: NVIDIA's ``aiperf`` (PyPI ``aiperf==0.13.0``, ``requirements-bench.txt``), run as
a separate program from its own virtual environment (``make bench`` creates ``.venv-bench``):
it pins ``prometheus-client~=0.23`` against the site's 0.21 and pulls ~80 packages (pandas,
transformers, dash …) the site and its tests do not need. It runs offline: the tokenizer is a
local directory (no Hub lookup for a path), and the bench points ``HTTP(S)_PROXY`` at a closed
port (only 127.0.0.1 is exempt), so any attempt to reach the network fails the run.

Model: the shipped qwen3-MoE fixture (``tests/fixtures/qwen3_moe_tiny``, vocab 256) copied with
a byte-level ``tokenizer.json`` written here (``tokenizers``: token id = byte value, no merges,
256 entries, so every id is in the model's vocabulary; the fixture itself ships none and aiperf
sends text). The site publishes it with the model (``prepare.backbone``) and encodes prompts
with it; aiperf makes its synthetic prompts with the same tokenizer (exactly ``--prompt``
tokens) and counts output tokens from the server's ``usage`` (``--use-server-token-count``).
Requests: ``/v1/completions``, streamed, ``temperature`` 0, ``max_tokens`` ``--tokens`` (the
fixture has no EOS: every request gets them all).

Two modes, same workload, same cores (the site, its agents and aiperf are pinned to
``--cpus``), each on a fresh ``tenzro_cluster`` of ``--holders`` agents (replication 2):
``distributed``, the agents hold every expert; ``in-process``, every expert is also loaded
into the site's own runtime (``tenzro_moeExpertLoad`` without a provider), so each MoE layer
runs in the site process (transport "local") and no batch leaves it (the idle agents stay up). Per mode
and concurrency C: aiperf sends ``C * --requests-per-client`` requests keeping C in flight,
after one warm-up request per mode. Reported: output tokens/s, TTFT and inter-token latency
p50/p99 (ms), errors, tokens/s relative to C=1 of the same mode, and distributed ÷
in-process tokens/s. ``cpu``: the CPU model and the SIMD path of the quantized kernels.

Per run it also prints what the site's own ``/metrics`` said (aiperf scrapes it during the
run): holder batches, the worst per-holder p99 and failed batches. Prints a table, and with
``--json`` one JSON object last. aiperf's own artifacts (per-request
records, its scrape of the site's ``/metrics``) are kept under ``--artifacts`` when given.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")

import httpx  # noqa: E402

from machine import cpu_model, int_at_least, int_list, parse_cpus  # noqa: E402
from tests.cluster_util import env_for, rpc, running_cluster  # noqa: E402
from tests.conftest import QWEN  # noqa: E402

MODEL = "qwen3-moe-tiny"
MODES = ("distributed", "in-process")
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


def bench_model(tmp: Path) -> Path:
    """The fixture's config and weights plus the byte-level tokenizer, in ``tmp/model``."""
    out = tmp / "model"
    out.mkdir()
    config = json.loads((QWEN / "config.json").read_text())
    if config["vocab_size"] < 256:
        raise SystemExit(f"{QWEN}: vocab_size {config['vocab_size']} < 256, too small for a byte tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(QWEN / name, out / name)
    (out / "tokenizer.json").write_text(byte_tokenizer_json())
    # aiperf loads it with transformers' AutoTokenizer, which wants the class named.
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "model_max_length": config["max_position_embeddings"]}))
    return out


def load_experts_on_site(url: str, token: str) -> int:
    """Load every published expert of ``MODEL`` into the site's own runtime; returns how many."""
    holdings = httpx.get(f"{url}/api/v1/holdings", params={"model_id": MODEL}, timeout=60).json()["holdings"]
    uris = {(h["layer"], h["expert"]): h["blob_uri"] for h in holdings}
    for (layer, expert), uri in sorted(uris.items()):
        r = rpc(f"{url}/rpc", "tenzro_moeExpertLoad", {"model_id": MODEL, "layer": layer, "expert": expert,
                                                       "uri": uri}, token=token)
        if "error" in r:
            raise SystemExit(f"loading expert {layer}/{expert} on the site failed: {r['error']}")
    return len(uris)


def warm_up(url: str, tokens: int) -> None:
    """One request through the whole path (gates, backbone, expert caches) before measuring."""
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "warm up the serving path",
                                                  "max_tokens": tokens, "temperature": 0}, timeout=600)
    r.raise_for_status()


class RunFailed(Exception):
    """One aiperf run did not finish (it failed, or the site stopped answering)."""


def run_aiperf(aiperf: str, url: str, tokenizer: Path, concurrency: int, requests: int, prompt: int, tokens: int,
               out: Path, endpoint: str = "completions", request_timeout: float = 120.0,
               startup_s: float = 120.0) -> tuple[dict, dict | None]:
    """One aiperf profile; returns its ``profile_export_aiperf.json`` and its scrape of the site's
    ``/metrics`` (None when absent). A request unanswered after ``request_timeout`` s is an
    error; aiperf still running ``startup_s`` after every round of requests could have timed
    out is killed (its whole process group: it forks services). Raises ``RunFailed``."""
    cmd = [aiperf, "profile", "--model", MODEL, "--url", url, "--endpoint-type", endpoint, "--streaming",
           "--tokenizer", str(tokenizer), "--use-server-token-count",
           "--synthetic-input-tokens-mean", str(prompt), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(tokens), "--output-tokens-stddev", "0", "--extra-inputs", "temperature:0",
           "--concurrency", str(concurrency), "--request-count", str(requests), "--random-seed", "1",
           "--artifact-dir", str(out), "--ui-type", "none", "--no-gpu-telemetry",
           "--request-timeout-seconds", f"{request_timeout:g}"]
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

    errors = sum(int(e.get("count", 1)) for e in report.get("error_summary") or [])
    return {"concurrency": concurrency, "requests": int(stat("request_count", "avg") or 0), "errors": errors,
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
                    help="comma list of distributed, in-process (default both)")
    ap.add_argument("--cpus", default=None, help="CPU set of the site, its agents and aiperf (default: this "
                                                 "process's affinity), e.g. 0-1")
    ap.add_argument("--aiperf", default=None, help="aiperf executable (default: $TENZRO_AIPERF, "
                                                   ".venv-bench/bin/aiperf, PATH)")
    ap.add_argument("--artifacts", default=None, help="keep aiperf's artifacts in this directory")
    ap.add_argument("--json", action="store_true", help="also print one JSON object")
    a = ap.parse_args(argv)
    ctx = json.loads((QWEN / "config.json").read_text())["max_position_embeddings"]
    chat = CHAT_OVERHEAD if a.endpoint == "chat" else 0
    if a.prompt + a.tokens > ctx - chat:
        ap.error(f"argument --tokens: --prompt + --tokens is {a.prompt + a.tokens}, over the fixture's context "
                 f"of {ctx} positions" + (f" less {chat} for the chat rendering" if chat else ""))
    try:
        cpus = parse_cpus(a.cpus)
    except ValueError as exc:
        ap.error(str(exc))
    aiperf = find_aiperf(a.aiperf)
    os.sched_setaffinity(0, cpus)  # inherited by the cluster, its agents and aiperf

    results: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as t:
        tmp = Path(t)
        arts = Path(a.artifacts) if a.artifacts else tmp / "aiperf"
        arts.mkdir(parents=True, exist_ok=True)
        model = bench_model(tmp)
        for mode in a.modes:
            # A fresh cluster per mode: nothing one mode left running (threads of finished or
            # cancelled generations, background recording) lands on the other's numbers.
            run_dir = tmp / mode
            run_dir.mkdir()
            started = time.perf_counter()
            with running_cluster(run_dir, [model], holders=a.holders, env=env_for(run_dir), timeout=600,
                                 extra=("--model-id", MODEL)) as (info, _proc):
                print(f"{mode}: cluster of {a.holders} holders up in {time.perf_counter() - started:.0f} s at "
                      f"{info['url']}; aiperf {aiperf}; CPUs {cpus}", flush=True)
                if mode == "in-process":
                    n = load_experts_on_site(info["url"], info["operator_token"])
                    print(f"in-process: {n} experts loaded into the site's runtime", flush=True)
                warm_up(info["url"], a.tokens)
                results[mode] = []
                for c in a.concurrency:
                    try:
                        report, server = run_aiperf(aiperf, info["url"], model, c, c * a.requests_per_client,
                                                    a.prompt, a.tokens, arts / f"{mode}-c{c}", a.endpoint,
                                                    a.request_timeout)
                    except RunFailed as exc:  # the site is likely wedged: the mode's higher C would be too
                        print(f"{mode} C={c}: FAILED: {exc}", flush=True)
                        failed[mode] = f"C={c}: {str(exc).splitlines()[0]}"
                        break
                    row = summarize(report, c, server)
                    results[mode].append(row)
                    hs = row["holders"].values()
                    print(f"{mode} C={c}: {row['tokens_per_s']} tok/s, TTFT p50 {row['ttft_ms']['p50']} ms, "
                          f"ITL p50 {row['itl_ms']['p50']} ms, {row['errors']} errors; holder batches "
                          f"{sum(h['batches'] for h in hs)}, worst p99 "
                          f"{max((h['p99_ms'] or 0 for h in hs), default=0)} ms, "
                          f"{sum(h['failures'] for h in hs)} failed (site /metrics)", flush=True)
    print()
    print(f"cpu: {cpu_description()}; CPUs {cpus} shared by the site, {a.holders} agents and aiperf")
    path = "/v1/chat/completions" if a.endpoint == "chat" else "/v1/completions"
    print(f"workload: {path} streamed, greedy, {a.prompt} prompt + {a.tokens} output tokens, "
          f"{a.requests_per_client} requests per client; model {MODEL} (byte-level tokenizer)")
    for line in table(results):
        print(line)
    for mode, why in failed.items():
        print(f"{mode}: stopped at {why}")
    if a.json:
        print(json.dumps({"cpu": cpu_description(), "cpus": cpus, "holders": a.holders, "endpoint": a.endpoint,
                          "prompt": a.prompt,
                          "tokens": a.tokens, "requests_per_client": a.requests_per_client, "results": results,
                          "failed": failed}))


if __name__ == "__main__":
    main()
