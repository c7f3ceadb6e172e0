"""Pages and HTTP endpoints of ``prepare``: ``GET /blobs/<hash>`` (with Range) and the job pages."""
from __future__ import annotations

import re

from django.conf import settings
from django.http import Http404, JsonResponse, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from moe.blobs import BlobStore

from moe.content import BlobError, check_hash
from prepare.jobs import job_status
from prepare.models import PrepareJob

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CHUNK = 1 << 20


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """Parse a single ``Range: bytes=a-b`` (also ``a-`` and ``-n``) against ``size``.

    Returns (start, end inclusive), None to serve the whole blob (no or unparsable header:
    RFC 9110 lets a server ignore it), or "unsatisfiable"."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # suffix: the last n bytes
        n = int(m.group(2))
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if start >= size or end < start:
        return "unsatisfiable"
    return start, min(end, size - 1)


def _stream(path, start: int, length: int):
    with open(path, "rb") as fh:
        fh.seek(start)
        while length > 0:
            chunk = fh.read(min(_CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk


@csrf_exempt  # a POST gets the JSON 405 below, not the CSRF failure page
def blob(request, blob_hash: str):
    """Serve a stored blob: 200 with the whole blob, or 206 with the single byte range the
    ``Range`` header asks for (``Content-Range``), 416 when the range lies outside it; 400
    for a malformed hash, 404 when absent, 405 for other methods than GET/HEAD."""
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"error": "use GET"}, status=405)
    try:
        check_hash(blob_hash)
    except BlobError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    path = BlobStore(settings.TENZRO["BLOB_DIR"]).path(blob_hash)
    if not path.is_file():
        return JsonResponse({"error": f"blob {blob_hash} not found"}, status=404)
    size = path.stat().st_size
    rng = _byte_range(request.headers.get("Range"), size)
    if rng == "unsatisfiable":
        resp = JsonResponse({"error": f"range {request.headers.get('Range')!r} is outside the {size}-byte blob"},
                            status=416)
        resp["Content-Range"] = f"bytes */{size}"
        return resp
    start, end = rng if rng else (0, size - 1)
    length = end - start + 1 if size else 0
    body = _stream(path, start, length) if request.method == "GET" else iter(())
    resp = StreamingHttpResponse(body, status=206 if rng else 200, content_type="application/octet-stream")
    resp["Content-Length"] = str(length)
    resp["Accept-Ranges"] = "bytes"
    resp["ETag"] = f'"{blob_hash}"'
    resp["Cache-Control"] = "public, max-age=31536000, immutable"
    if rng:
        resp["Content-Range"] = f"bytes {start}-{end}/{size}"
    return resp


#: htmx stops polling an element when its answer has this status (htmx docs, "hx-trigger every").
HTMX_STOP_POLLING = 286


def _jobs():
    return PrepareJob.objects.all()[:100]


def jobs(request):
    """``/prepare/``: recent preparation jobs with their progress; the rows refresh themselves
    (htmx polling of ``/prepare/rows``) while a job is pending or running."""
    rows = _jobs()
    return render(request, "prepare/jobs.html", {"jobs": rows, "live": any(not j.done for j in rows),
                                                 "nav_section": "prepare"})


def job_rows(request):
    """``/prepare/rows``: the jobs table body (htmx fragment); answers 286 (stop polling) once
    every listed job is final."""
    rows = _jobs()
    live = any(not j.done for j in rows)
    return render(request, "prepare/_job_rows.html", {"jobs": rows, "live": live},
                  status=200 if live else _final_status(request))


def _final_status(request) -> int:
    """286 for an htmx poll (stops it), 200 for a plain request."""
    return HTMX_STOP_POLLING if request.headers.get("HX-Request") == "true" else 200


def _job_or_404(job_id) -> PrepareJob:
    job = PrepareJob.objects.filter(job_id=job_id).first()
    if job is None:
        raise Http404(f"no preparation job {job_id}")
    return job


def job_detail(request, job_id):
    """``/prepare/<job_id>``: one job's progress (live while it runs), published experts,
    failures and fallbacks."""
    job = _job_or_404(job_id)
    return render(request, "prepare/job.html", {"job": job, "s": job_status(job), "nav_section": "prepare"})


def job_progress(request, job_id):
    """``/prepare/<job_id>/progress``: the progress block (experts done/total, bytes, current
    tensor, state) as an htmx fragment, polled every second; 286 once the job is final."""
    job = _job_or_404(job_id)
    status = _final_status(request) if job.done else 200
    return render(request, "prepare/_progress.html", {"job": job}, status=status)


__all__ = ["blob", "jobs", "job_rows", "job_detail", "job_progress"]


def expert_shard(request, model: str):
    """``GET /api/proxy/models/{model}/expert-shard`` (Kvasir contract §1.10; node token or service
    token, also as ``?service_token=``): the mini-GGUF of ``?layer=L&expert_begin=a&expert_end=b``
    or ``?layers=A:B&experts=a:b`` (``prepare.expert_shard``), with ``Content-Length``,
    ``X-Kvasir-Shard-Digest`` (SHA-256 hex of the body) and ``X-Kvasir-Shard-Manifest-Bytes``.
    Errors are ``{"error"}``: 401, 400, 404, 405, 413."""
    from django.http import FileResponse

    from prepare import expert_shard as shards
    from registry import market

    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"error": "use GET"}, status=405)
    try:
        market.authenticate(request.headers, request.GET.get("service_token"))
        built = shards.build_shard(model, shards.parse_query(request.GET), BlobStore(settings.TENZRO["BLOB_DIR"]))
    except market.MarketError as exc:
        return JsonResponse({"error": exc.message}, status=exc.status)
    fh = open(built.path, "rb")
    built.path.unlink()  # the open handle keeps the data until the response closes it
    s = built.spec
    resp = FileResponse(fh, content_type="application/octet-stream",
                        filename=f"{market.basename(s.model)}-L{s.layer}-E{s.expert_begin}-{s.expert_end}.gguf")
    resp["Content-Length"] = str(built.size)
    resp["X-Kvasir-Shard-Digest"] = built.digest
    resp["X-Kvasir-Shard-Manifest-Bytes"] = str(built.manifest_bytes)
    return resp
