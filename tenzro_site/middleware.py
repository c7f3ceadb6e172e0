"""Django's middleware, with its hooks run on the event loop under ASGI.

Django runs each hook of a ``MiddlewareMixin`` class in a thread when the site is served
over ASGI (``sync_to_async``), whatever the hook does: 13 thread hand-offs per request for
the stack in ``settings.MIDDLEWARE``, ~3 % of the site's GIL samples at 16 clients of
``/v1/completions``. The hooks of these classes only read headers and cookies and set
attributes, so they run inline here; what can reach the database keeps its thread: saving a
modified session (``SessionMiddleware``), message storage that was used (it writes into
the session) and the CSRF check of a form post (it parses the body). Under WSGI or the sync
test client nothing changes (``MiddlewareMixin.__call__``).
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.middleware import clickjacking, common, csrf, security


class InlineHooks:
    """Mixin placed before a ``MiddlewareMixin`` class: in async mode its ``process_request``,
    ``process_view`` and ``process_response`` run on the event loop, except a response that
    ``response_needs_thread`` says may touch the database."""

    def __init__(self, get_response):
        super().__init__(get_response)
        if self.async_mode and hasattr(self, "process_view"):
            view_hook = self.process_view

            async def process_view(request, view_func, view_args, view_kwargs):  # Django awaits a coroutine hook
                if self.view_needs_thread(request, view_func):
                    return await sync_to_async(view_hook, thread_sensitive=True)(request, view_func, view_args,
                                                                                  view_kwargs)
                return view_hook(request, view_func, view_args, view_kwargs)

            self.process_view = process_view

    def view_needs_thread(self, request, view_func) -> bool:
        """Whether ``process_view`` may do long or blocking work for this request (default: never)."""
        return False

    def response_needs_thread(self, request, response) -> bool:
        """Whether ``process_response`` may do blocking I/O for this request (default: never)."""
        return False

    async def __acall__(self, request):
        response = self.process_request(request) if hasattr(self, "process_request") else None
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            if self.response_needs_thread(request, response):
                return await sync_to_async(self.process_response, thread_sensitive=True)(request, response)
            return self.process_response(request, response)
        return response


class SecurityMiddleware(InlineHooks, security.SecurityMiddleware):
    """``django.middleware.security.SecurityMiddleware``, hooks inline under ASGI."""


class SessionMiddleware(InlineHooks, sessions.SessionMiddleware):
    """``django.contrib.sessions.middleware.SessionMiddleware``: a session that is saved (modified,
    or ``SESSION_SAVE_EVERY_REQUEST``) is saved on the request's thread."""

    def response_needs_thread(self, request, response) -> bool:
        session = getattr(request, "session", None)
        return session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST)


class CommonMiddleware(InlineHooks, common.CommonMiddleware):
    """``django.middleware.common.CommonMiddleware``, hooks inline under ASGI."""


class CsrfViewMiddleware(InlineHooks, csrf.CsrfViewMiddleware):
    """``django.middleware.csrf.CsrfViewMiddleware`` (the token in a cookie: no session read). A
    form post to a view that checks the token keeps its thread: the check parses the form body
    (up to ``DATA_UPLOAD_MAX_MEMORY_SIZE``), which must not hold the event loop; safe methods
    and ``csrf_exempt`` views (the JSON APIs) are checked inline."""

    def __init__(self, get_response):
        if settings.CSRF_USE_SESSIONS:  # the secret would come from the session (a database read)
            raise ValueError("tenzro_site.middleware.CsrfViewMiddleware needs CSRF_USE_SESSIONS = False")
        super().__init__(get_response)

    def view_needs_thread(self, request, view_func) -> bool:
        return request.method not in ("GET", "HEAD", "OPTIONS", "TRACE") and not getattr(view_func, "csrf_exempt",
                                                                                          False)


class AuthenticationMiddleware(InlineHooks, auth.AuthenticationMiddleware):
    """``django.contrib.auth.middleware.AuthenticationMiddleware`` (it sets a lazy user: the
    database is read by whoever uses it)."""


class MessageMiddleware(InlineHooks, messages.MessageMiddleware):
    """``django.contrib.messages.middleware.MessageMiddleware``: storage that was used is written
    (into the session, which may load it) on the request's thread."""

    def response_needs_thread(self, request, response) -> bool:
        storage = getattr(request, "_messages", None)
        return storage is not None and (storage.used or storage.added_new)


class XFrameOptionsMiddleware(InlineHooks, clickjacking.XFrameOptionsMiddleware):
    """``django.middleware.clickjacking.XFrameOptionsMiddleware``, hooks inline under ASGI."""
