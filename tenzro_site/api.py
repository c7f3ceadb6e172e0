"""REST plumbing shared by the apps: an exception handler that never leaks a traceback, a JSON parser."""
from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig

from moe import jsonrpc
from moe.jsonrpc import ParamError
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser as DRFJSONParser
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

log = logging.getLogger(__name__)


def body_too_big_message() -> str:
    """The refusal of a request body over ``TENZRO_MAX_BODY`` (Django's ``RequestDataTooBig``)."""
    return f"request body is over this site's {settings.DATA_UPLOAD_MAX_MEMORY_SIZE}-byte limit (TENZRO_MAX_BODY)"


def exception_handler(exc, context):
    """DRF errors as ``{"error": message}`` (plus ``field`` when the exception names one) with their status.

    A body over ``TENZRO_MAX_BODY`` (Django's ``RequestDataTooBig``, from a view reading
    ``request.body`` of a chunked upload) is a 413. Anything else is logged and answered as a 500
    without details.
    """
    if isinstance(exc, RequestDataTooBig):
        return Response({"error": body_too_big_message(), "field": "body"}, status=413)
    response = drf_exception_handler(exc, context)
    if response is None:
        log.exception("unhandled API error", exc_info=exc)
        return Response({"error": "internal error; the site log has the details"}, status=500)
    detail = response.data.get("detail") if isinstance(response.data, dict) else None
    response.data = {"error": str(detail) if detail is not None else response.data}
    if getattr(exc, "field", None):
        response.data["field"] = exc.field
    return response


class JSONParser(DRFJSONParser):
    """DRF's JSON parser through ``moe.jsonrpc.loads``, the one body parser of the site: bad
    JSON, NaN/Infinity, nesting deeper than ``moe.jsonrpc.MAX_DEPTH`` and lone surrogates are
    a 400 parse error (its ``field`` the path of a refused string)."""

    def parse(self, stream, media_type=None, parser_context=None):
        """Parse the body (UTF-8, as JSON requires); raises ``ParseError``."""
        try:
            return jsonrpc.loads(stream.read())
        except ParamError as exc:
            err = ParseError(f"JSON parse error - {exc}")
            err.field = exc.field
            raise err from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
