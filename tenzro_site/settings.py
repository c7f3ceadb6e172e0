"""Settings for the Tenzro distributed MoE site, driven by environment variables.

One place maps the environment to backends (docs/DESIGN.md §4):

- ``DATABASE_URL``: any dj-database-url URL; default an SQLite file ``db.sqlite3`` in the
  project root (IMMEDIATE transactions, WAL, busy timeout).
- ``REDIS_URL``: present → channels-redis channel layer, Redis cache, Celery broker and
  result backend on it; absent → in-memory channel layer, local-memory cache and Celery
  tasks run inline in the calling process.
- ``TENZRO_VAR_DIR`` (default ``var/``): keys, blobs, operator token, secret key.
- ``TENZRO_DEPLOYMENT`` (default ``default``): the deployment this process belongs to; one per
  database (``registry.deployment``). ``TENZRO_SITE_ID`` / ``TENZRO_SITE_IDS``: behind a
  balancer, this process's server name and every site process's (comma list); agents open a
  socket to each (``router.consumers``). ``TENZRO_DB_POOL`` (connections per process, default 8;
  0 = no pool) and ``TENZRO_DB_POOL_TIMEOUT`` (seconds): psycopg's pool on PostgreSQL.
- ``PROMETHEUS_MULTIPROC_DIR``: set (an empty directory per machine) when several site
  processes or workers run on one machine: ``/metrics`` of any of them then sums all
  (``router.metrics``).
- ``TENZRO_BLOB_DIR`` (default ``$TENZRO_VAR_DIR/blobs``), ``TENZRO_MEMORY_BUDGET`` (bytes),
  ``TENZRO_KEY_FILE``, ``TENZRO_OPERATOR_TOKEN``, ``TENZRO_ALLOWED_HOSTS`` (comma list),
  ``TENZRO_DEBUG`` (0/1), ``TENZRO_WS_MAX_MESSAGE`` (bytes, default 1 MiB), slow-client
  deadlines of the HTTP server (``tenzro_site.serve``): ``TENZRO_HTTP_HEADER_TIMEOUT``,
  ``TENZRO_HTTP_BODY_TIMEOUT`` (seconds, default 20 each), ``TENZRO_HTTP_BODY_MIN_RATE``
  (bytes per second, default 500),
  ``TENZRO_HEARTBEAT_INTERVAL`` (seconds, default 15), ``TENZRO_MAX_BODY`` (bytes),
  ``TENZRO_GOVERNANCE_MIN_REPUTATION`` (default 600), ``TENZRO_PLAN_SPLIT_THRESHOLD`` (tokens,
  default 256; 0 = never split), ``TENZRO_API_READ_RATE`` / ``TENZRO_API_WRITE_RATE`` (DRF
  rates, default ``1200/min`` / ``300/min``), admission control (``router.admission``):
  ``TENZRO_RPC_MAX_BATCH``, ``TENZRO_FORWARD_CONCURRENCY``, ``TENZRO_FORWARD_QUEUE``,
  ``TENZRO_FORWARD_QUEUE_WAIT`` (seconds), ``TENZRO_FORWARD_RATE`` (per client per minute);
  generation size (``router.generate.check_size``): ``TENZRO_GEN_MAX_PROMPTS``,
  ``TENZRO_GEN_MAX_PROMPT_TOKENS``, ``TENZRO_GEN_MAX_NEW_TOKENS``; ``TENZRO_CELERY_QUEUE`` (the
  Celery task queue, default ``celery``). Data plane: ``TENZRO_DATA_TRANSPORT`` (ws|http|iroh),
  ``TENZRO_COALESCE`` (checked here, read by the transports), ``TENZRO_IROH_BIND`` (HOST:PORT),
  ``TENZRO_BATCH_TIMEOUT`` / ``TENZRO_BATCH_DEADLINE`` (seconds > 0), ``TENZRO_VIEW_CACHE``
  (seconds >= 0). A malformed value raises ``RuntimeError`` naming the variable at import.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TENZRO_VAR_DIR", BASE_DIR / "var")).resolve()
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _env_int(name: str, default: int, minimum: int | None = None) -> int:
    """An integer from the environment, at least ``minimum`` when given (a count of 0 would
    stall the site, a negative one read as no limit); raises ``RuntimeError`` naming the variable."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        v = int(value)
    except ValueError as exc:
        raise RuntimeError(f"{name} must be an integer, got {value!r}") from exc
    if minimum is not None and v < minimum:
        raise RuntimeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def _env_float(name: str, default: float, zero_ok: bool = False) -> float:
    """A finite number of seconds > 0 (``zero_ok``: >= 0) from the environment; raises
    ``RuntimeError`` naming the variable."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        v = float(value)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise RuntimeError(f"{name} must be a number of seconds {'>= 0' if zero_ok else 'above 0'}, got {value!r}")
    return v


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (exactly: the transports compare the raw value) from the environment;
    unset or empty → ``default``; raises ``RuntimeError`` naming the variable."""
    value = os.environ.get(name) or default
    if value not in choices:
        raise RuntimeError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _env_site_ids() -> tuple[str | None, tuple[str, ...]]:
    """``TENZRO_SITE_ID`` (this process's server name in the balancer) and ``TENZRO_SITE_IDS``
    (comma list: every site process of the deployment); both or neither, names of letters,
    digits, ``-`` and ``_``, and the list must name this process. Raises ``RuntimeError``."""
    own = os.environ.get("TENZRO_SITE_ID", "").strip() or None
    ids = tuple(x.strip() for x in os.environ.get("TENZRO_SITE_IDS", "").split(",") if x.strip())
    if (own is None) != (not ids):
        raise RuntimeError("TENZRO_SITE_ID and TENZRO_SITE_IDS go together (this process's balancer server name "
                           "and every site process's)")
    for name in ((own,) if own else ()) + ids:
        if len(name) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_") for c in name):
            raise RuntimeError(f"TENZRO_SITE_ID / TENZRO_SITE_IDS: {name!r} is not a server name "
                               "(letters, digits, '-', '_'; at most 64)")
    if own is not None and own not in ids:
        raise RuntimeError(f"TENZRO_SITE_IDS {','.join(ids)!r} must include TENZRO_SITE_ID {own!r}")
    return own, ids


def _env_host_port(name: str, default: str) -> str:
    """``HOST:PORT`` (port 0..65535) from the environment; raises ``RuntimeError`` naming the variable."""
    value = os.environ.get(name, "").strip() or default
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise RuntimeError(f"{name} must be HOST:PORT (port 0 = a free one), got {value!r}")
    return value


# TENZRO_COALESCE is read by the transports at each send (a bench flips it); refuse here what
# they would silently read as "on".
_env_choice("TENZRO_COALESCE", "1", ("1", "0", "true", "false", "yes", "no", "on", "off"))
_env_choice("TENZRO_STREAM_ANSWERS", "1", ("1", "0", "true", "false", "yes", "no", "on", "off"))


def _secret_key() -> str:
    """SECRET_KEY from the environment, or generated once and kept under ``VAR_DIR``."""
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = VAR_DIR / "secret_key"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(secrets.token_urlsafe(50))
        os.replace(tmp, path)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = _env_bool("TENZRO_DEBUG", False)
ALLOWED_HOSTS = [
    h.strip()
    for h in os.environ.get("TENZRO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",")
    if h.strip()
]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_htmx",
    "django_celery_beat",  # the repair schedule, editable in the admin
    "registry",
    "router",  # the serving path; the Django-free core (holders) is a plain package
    "prepare",
    "settlement",
    "tenzro_site",  # the orchestration commands (tenzro_cluster, tenzro_demo, verify_forward)
]

MIDDLEWARE = [  # Django's own, with hooks on the event loop under ASGI (tenzro_site.middleware)
    "tenzro_site.middleware.SecurityMiddleware",
    "tenzro_site.middleware.SessionMiddleware",
    "tenzro_site.middleware.CommonMiddleware",
    "tenzro_site.middleware.CsrfViewMiddleware",
    "tenzro_site.middleware.AuthenticationMiddleware",
    "tenzro_site.middleware.MessageMiddleware",
    "tenzro_site.middleware.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "tenzro_site.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "tenzro_site" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "tenzro_site.console.nav.nav",
            ]
        },
    }
]
WSGI_APPLICATION = None
ASGI_APPLICATION = "tenzro_site.asgi.application"

_DB_POOL = _env_int("TENZRO_DB_POOL", 8, minimum=0)  # checked on every engine: a typo is caught on SQLite too
try:
    DATABASES = {
        "default": dj_database_url.parse(
            os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}", conn_max_age=0
        )
    }
except ValueError as exc:  # dj-database-url's UnknownSchemeError and malformed URLs
    raise RuntimeError(f"DATABASE_URL must be a dj-database-url URL such as postgres://user@host/db or "
                       f"sqlite:///path, got {os.environ.get('DATABASE_URL')!r}: {exc}") from exc
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A thread keeps its SQLite connection: reopening one per database_sync_to_async call (WAL
    # pragmas, Django's ~40 SQL functions registered again) was a visible share of the site's
    # CPU under load. Autocommit holds no lock between statements.
    DATABASES["default"]["CONN_MAX_AGE"] = 600
    # IMMEDIATE makes writers queue on the busy timeout instead of failing on lock upgrade.
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"].setdefault("TEST", {})
    if os.environ.get("TENZRO_TEST_SQLITE_FILE"):
        DATABASES["default"]["TEST"]["NAME"] = os.environ["TENZRO_TEST_SQLITE_FILE"]
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and _DB_POOL > 0:
    # psycopg's pool (Django >= 5.1): each process keeps at most TENZRO_DB_POOL connections however
    # many threads it runs (the DB thread, sync_to_async workers), so N site processes + workers stay
    # far under max_connections; a thread past the cap waits up to TENZRO_DB_POOL_TIMEOUT s.
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1, "max_size": _DB_POOL,
        "timeout": _env_float("TENZRO_DB_POOL_TIMEOUT", 30.0), "max_idle": 300.0}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
# Operator console (tenzro_site/console): staff log in with Django auth; everyone else reads.
LOGIN_URL = "console-login"
LOGIN_REDIRECT_URL = "index"
LOGOUT_REDIRECT_URL = "index"
STATIC_ROOT = VAR_DIR / "static"

REDIS_URL = os.environ.get("REDIS_URL", "").strip()
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py 8 reads with a 5 s socket timeout, the same as channels-redis's 5 s blocking
            # pop: give reads room so an idle consumer does not die with a TimeoutError.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}], "capacity": 1000, "expiry": 60,
                       "prefix": os.environ.get("TENZRO_CHANNEL_PREFIX", "tenzro")},
        }
    }
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": 1000}}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# Celery: a real broker when REDIS_URL is set, otherwise tasks run inline (eager).
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = REDIS_URL or "cache+memory://"
CELERY_TASK_ALWAYS_EAGER = not bool(REDIS_URL)
# The queue this site sends to and its workers consume: sites sharing one Redis database keep
# their tasks apart (each task touches its own site's database).
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("TENZRO_CELERY_QUEUE", "").strip() or "celery"
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_TIME_LIMIT = 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Beat reads its schedule from the database (django-celery-beat: editable in the admin).
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
_SITE_ID, _SITE_IDS = _env_site_ids()
_HYGIENE_INTERVAL_S = _env_int("TENZRO_HYGIENE_INTERVAL", 300, minimum=1)
# Receipts economy sweeps (settlement.tasks), synced into the database schedule by beat; without a
# broker an inline timer does the same.
# ``period_s``: each sweep runs once per period however many beats send it (registry.periodic).
CELERY_BEAT_SCHEDULE = {
    "settlement-audit-pending": {"task": "settlement.audit_pending", "schedule": 30.0,
                                 "kwargs": {"period_s": 30.0}},
    "settlement-settle-pending": {"task": "settlement.settle_pending", "schedule": 60.0,
                                  "kwargs": {"period_s": 60.0}},
    # Provider hygiene (registry.tasks): close sessions whose heartbeats stopped; expire unproven keys.
    "registry-sweep-stale-providers": {"task": "registry.sweep_stale_providers", "schedule": 60.0,
                                       "kwargs": {"period_s": 60.0}},
    "registry-expire-unproven-providers": {"task": "registry.expire_unproven_providers",
                                           "schedule": float(_HYGIENE_INTERVAL_S),
                                           "kwargs": {"period_s": float(_HYGIENE_INTERVAL_S)}},
}

# Request bodies: JSON-RPC carries base64 hidden states, so the cap is explicit.
DATA_UPLOAD_MAX_MEMORY_SIZE = _env_int("TENZRO_MAX_BODY", 64 * 1024 * 1024, minimum=1)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "tenzro_site.api.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PARSER_CLASSES": ["tenzro_site.api.JSONParser"],
}

# OpenAPI at /api/schema/, Swagger UI at /api/docs/ from the sidecar's static files (no CDN).
SPECTACULAR_SETTINGS = {
    "TITLE": "Tenzro distributed MoE",
    # Markdown in Swagger UI: the header sits in a code span, or "<token>" is eaten as an HTML tag.
    "DESCRIPTION": "REST mirror of the JSON-RPC methods at `POST /rpc` (design: `docs/DESIGN.md` §6 of the "
                   "source tree). Management endpoints "
                   "(marked with a lock) need the operator credential, `Authorization: Bearer <operator token>`: "
                   "the token is `$TENZRO_VAR_DIR/operator_token` or `TENZRO_OPERATOR_TOKEN`. Click Authorize "
                   "and paste the token alone.",
    # "operatorToken" is named by registry.api.OPERATOR_AUTH on the operator endpoints.
    "APPEND_COMPONENTS": {"securitySchemes": {"operatorToken": {
        "type": "http", "scheme": "bearer",
        "description": "The site's operator token (`$TENZRO_VAR_DIR/operator_token` or `TENZRO_OPERATOR_TOKEN`)."}}},
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

TENZRO = {
    # One deployment name per database (registry.deployment): every process of one deployment
    # gives the same; a process of another deployment is refused by the database it would share.
    "DEPLOYMENT": os.environ.get("TENZRO_DEPLOYMENT", "").strip() or "default",
    # Several site processes behind the balancer: this one's server name and every one's. The
    # welcome lists them; agents then hold a socket to each (``?site=<id>``, HAProxy use-server),
    # so every router reaches every agent without the channel-layer relay (router.consumers).
    "SITE_ID": _SITE_ID,
    "SITE_IDS": _SITE_IDS,
    "BLOB_DIR": Path(os.environ.get("TENZRO_BLOB_DIR", VAR_DIR / "blobs")).resolve(),
    "HEARTBEAT_INTERVAL_S": _env_int("TENZRO_HEARTBEAT_INTERVAL", 15, minimum=1),
    "MISSED_HEARTBEATS": 3,
    # Provider hygiene: a provider that never served a batch, holds no balance and has not been
    # seen (heartbeat, else creation) for this many seconds is deleted (registry.expire_unproven_providers,
    # every TENZRO_HYGIENE_INTERVAL s). A holder whose latest batch failed within the failing
    # window shows as "Failing" (listings, /healthz).
    "UNPROVEN_PROVIDER_TTL_S": _env_int("TENZRO_UNPROVEN_PROVIDER_TTL", 3600, minimum=1),
    "HYGIENE_INTERVAL_S": _HYGIENE_INTERVAL_S,
    "FAILING_WINDOW_S": _env_int("TENZRO_FAILING_WINDOW", 300, minimum=0),
    "CLOCK_SKEW_S": 60,
    # Daphne's WebSocket message cap (set explicitly when we start daphne); frames stay below it.
    "WS_MAX_MESSAGE": _env_int("TENZRO_WS_MAX_MESSAGE", 1024 * 1024, minimum=1024),
    # Slow-client deadlines of the HTTP server (tenzro_site.serve, Apache mod_reqtimeout's
    # defaults): a request's headers within HTTP_HEADER_TIMEOUT_S of its first byte, its body
    # within HTTP_BODY_TIMEOUT_S plus one second per HTTP_BODY_MIN_RATE bytes received.
    "HTTP_HEADER_TIMEOUT_S": _env_float("TENZRO_HTTP_HEADER_TIMEOUT", 20.0),
    "HTTP_BODY_TIMEOUT_S": _env_float("TENZRO_HTTP_BODY_TIMEOUT", 20.0),
    "HTTP_BODY_MIN_RATE": _env_int("TENZRO_HTTP_BODY_MIN_RATE", 500, minimum=1),
    "AGENT_HELLO_TIMEOUT_S": 10,
    "BATCH_TIMEOUT_S": _env_float("TENZRO_BATCH_TIMEOUT", 30.0),
    "RPC_RATE_PER_MINUTE": _env_int("TENZRO_RPC_RATE", 6000, minimum=0),
    # REST heartbeats (registry.heartbeat): provider keys the site has not seen, per client
    # address per minute (0 = unlimited); experts a key that has served no batch may declare.
    "NEW_KEY_RATE_PER_MINUTE": _env_int("TENZRO_NEW_KEY_RATE", 4, minimum=0),
    "PROBATION_HOLDINGS": _env_int("TENZRO_PROBATION_HOLDINGS", 32_768, minimum=0),
    # Admission control (router.admission): requests in one JSON-RPC batch; distributed forwards
    # running at once per site process, how many more may queue and for how many seconds;
    # forward-method calls per client address per minute (0 = unlimited).
    "RPC_MAX_BATCH": _env_int("TENZRO_RPC_MAX_BATCH", 100, minimum=1),
    "FORWARD_CONCURRENCY": _env_int("TENZRO_FORWARD_CONCURRENCY", 16, minimum=1),
    "FORWARD_QUEUE": _env_int("TENZRO_FORWARD_QUEUE", 1024, minimum=0),
    "FORWARD_QUEUE_WAIT_S": _env_float("TENZRO_FORWARD_QUEUE_WAIT", 60.0, zero_ok=True),
    "FORWARD_RATE_PER_MINUTE": _env_int("TENZRO_FORWARD_RATE", 3000, minimum=0),
    # Size of one generation (tenzro_moeGenerate, /v1/completions, /v1/chat/completions): prompts in
    # the batch, their tokens together, and new tokens together (prompts × max_new_tokens). The
    # site holds every sequence's KV cache: the defaults keep a 2-core demo machine responsive.
    "GEN_MAX_PROMPTS": _env_int("TENZRO_GEN_MAX_PROMPTS", 64, minimum=1),
    "GEN_MAX_PROMPT_TOKENS": _env_int("TENZRO_GEN_MAX_PROMPT_TOKENS", 8192, minimum=1),
    "GEN_MAX_NEW_TOKENS": _env_int("TENZRO_GEN_MAX_NEW_TOKENS", 8192, minimum=1),
    # The per-model scheduler (router.scheduler): prompt rows per step, KV cache bytes of all
    # running sequences, sequences in a step, and sequences that may wait for admission.
    "GEN_PREFILL_CHUNK": _env_int("TENZRO_PREFILL_CHUNK", 512, minimum=1),
    "GEN_KV_BUDGET_BYTES": _env_int("TENZRO_KV_BUDGET_BYTES", 4 << 30, minimum=1),
    "GEN_MAX_RUNNING": _env_int("TENZRO_GEN_MAX_RUNNING", 64, minimum=1),
    "GEN_QUEUE": _env_int("TENZRO_GEN_QUEUE", 256, minimum=0),
    # Micro-batches of one step in flight at once (router.scheduler): while one's expert rows are on
    # the wire the next one's attention runs; the count follows observed wait and compute, up to this.
    "GEN_MICROBATCHES": _env_int("TENZRO_GEN_MICROBATCHES", 4, minimum=1),
    # Disaggregated generation's KV handoff: "peer" (Prefill agent → Decode agent over iroh / HTTP
    # when the Decode agent advertises an endpoint) or "site" (relayed through the agent sockets).
    "KV_HANDOFF": _env_choice("TENZRO_KV_HANDOFF", "peer", ("peer", "site")),
    # Providers need this reputation (new ones start at 500) to vote on policy proposals.
    "GOVERNANCE_MIN_VOTER_REPUTATION": _env_int("TENZRO_GOVERNANCE_MIN_REPUTATION", 600),
    # tenzro_moePlanDispatch: split one expert's batch across warm replicas above this many tokens.
    "PLAN_SPLIT_THRESHOLD": _env_int("TENZRO_PLAN_SPLIT_THRESHOLD", 256, minimum=0),
    # REST mirror throttles per client address (DRF rate strings).
    "API_READ_RATE": os.environ.get("TENZRO_API_READ_RATE", "1200/min"),
    "API_WRITE_RATE": os.environ.get("TENZRO_API_WRITE_RATE", "300/min"),
    # Data plane of tenzro_moeForward (docs/DESIGN.md §7): seconds one holder has for one batch before
    # its warm backup gets it; "ws" (agent sockets, HTTP fallback), "http" (advertised
    # endpoints with binary frames, socket fallback) or "iroh" (advertised iroh endpoints, then
    # socket, then HTTP); the router's iroh endpoint binds to IROH_BIND; seconds the shard view
    # read is reused.
    "BATCH_DEADLINE_S": _env_float("TENZRO_BATCH_DEADLINE", 10.0),
    "DATA_TRANSPORT": _env_choice("TENZRO_DATA_TRANSPORT", "ws", ("ws", "http", "iroh")),
    "IROH_BIND": _env_host_port("TENZRO_IROH_BIND", "0.0.0.0:0"),
    "VIEW_CACHE_S": _env_float("TENZRO_VIEW_CACHE", 1.0, zero_ok=True),
    # Repair pass (docs/DESIGN.md §8): seconds between passes; 0 = the governance policy's
    # repair_interval_s (a local cluster or a test sets a short one). Release grace: seconds an
    # expert must stay above target and cool before its surplus replicas are dropped.
    "REPAIR_INTERVAL_S": _env_int("TENZRO_REPAIR_INTERVAL", 0, minimum=0),
    "REPAIR_RELEASE_GRACE_S": _env_int("TENZRO_REPAIR_RELEASE_GRACE", 600, minimum=0),
    # Seconds each agent has to answer its repair offer; one that does not is recorded as
    # declining its rows and the pass ends without it.
    "REPAIR_OFFER_TIMEOUT_S": _env_float("TENZRO_REPAIR_OFFER_TIMEOUT", 30.0),
    # Expert-coverage market (Kvasir contract §2): HMAC secret of node tokens (default: derived
    # from SECRET_KEY), token lifetime in seconds.
    "MARKET_TOKEN_SECRET": os.environ.get("TENZRO_MARKET_TOKEN_SECRET", ""),
    "MARKET_TOKEN_TTL_S": _env_int("TENZRO_MARKET_TOKEN_TTL", 30 * 86400, minimum=1),
    # Login challenges one client address may ask per minute (0 = unlimited).
    "MARKET_CHALLENGE_RATE_PER_MINUTE": _env_int("TENZRO_MARKET_CHALLENGE_RATE", 30, minimum=0),
    # Machine-to-machine secret accepted in X-Kvasir-Service-Token / X-Linkcpp-Service-Token (unset: none).
    "MARKET_SERVICE_TOKEN": os.environ.get("TENZRO_MARKET_SERVICE_TOKEN", ""),
    # Relay sockets (contract §1.8): credit units per MB carried (max of the two directions),
    # seconds between credits of an open socket, and seconds between a socket's checks that its
    # session is still live (a session quiet for 120 s is evicted, and its socket closed).
    "MARKET_RELAY_UNITS_PER_MB": _env_float("TENZRO_MARKET_RELAY_UNITS_PER_MB", 1.0, zero_ok=True),
    "MARKET_RELAY_CREDIT_S": _env_float("TENZRO_MARKET_RELAY_CREDIT", 60.0),
    "MARKET_RELAY_CHECK_S": _env_float("TENZRO_MARKET_RELAY_CHECK", 15.0),
}

def _without_traceback(record: logging.LogRecord) -> bool:
    """Log filter: keep the record, drop its traceback."""
    record.exc_info, record.exc_text = None, None
    return True


# django.security logs every SuspiciousOperation a client causes (a foreign Host header, ...)
# with its traceback: 30 lines per request, which any client could flood the log with. One line each.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"without_traceback": {"()": lambda: _without_traceback}},
    "handlers": {"console": {"class": "logging.StreamHandler"},
                 "security": {"class": "logging.StreamHandler", "filters": ["without_traceback"]}},
    "loggers": {"django.security": {"handlers": ["security"], "propagate": False}},
    "root": {"handlers": ["console"], "level": os.environ.get("TENZRO_LOG_LEVEL", "WARNING")},
}
