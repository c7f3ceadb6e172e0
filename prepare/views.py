"""``GET /blobs/<hash>``: content-addressed blobs served from the site's store."""
from __future__ import annotations

from django.conf import settings
from django.http import FileResponse, JsonResponse

from prepare.blobs import BlobError, BlobStore, check_hash


def blob(request, blob_hash: str):
    """Stream a stored blob; 400 for a malformed hash, 404 when absent."""
    try:
        check_hash(blob_hash)
    except BlobError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    path = BlobStore(settings.TENZRO["BLOB_DIR"]).path(blob_hash)
    if not path.is_file():
        return JsonResponse({"error": f"blob {blob_hash} not found"}, status=404)
    resp = FileResponse(open(path, "rb"), content_type="application/octet-stream")
    resp["Cache-Control"] = "public, max-age=31536000, immutable"
    return resp
