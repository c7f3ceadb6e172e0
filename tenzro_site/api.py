"""REST plumbing shared by the apps: an exception handler that never leaks a traceback, a JSON parser."""
from __future__ import annotations

import logging

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser as DRFJSONParser
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

log = logging.getLogger(__name__)


def exception_handler(exc, context):
    """DRF errors as ``{"error": message}`` (plus ``field`` when the exception names one) with their status.

    Anything else is logged and answered as a 500 without details.
    """
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
    """DRF's JSON parser, with over-deep nesting (``RecursionError``) answered as a 400 parse error."""

    def parse(self, stream, media_type=None, parser_context=None):
        """Parse the body; raises ``ParseError``."""
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
