"""The Celery app, configured from Django settings (``CELERY_*``) and discovering ``<app>/tasks.py``."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")

app = Celery("tenzro_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

WORKERS_CACHE_S = 10  # /healthz asks the broker at most this often while a worker answers
NO_WORKERS_CACHE_S = 2  # ... and this often while none does (one that just started shows soon)


def queue_workers(timeout: float = 1.0) -> int:
    """How many Celery workers consume this site's task queue (``CELERY_TASK_DEFAULT_QUEUE``),
    asked over the broker (``inspect().active_queues()``, waiting ``timeout`` seconds); 0 when
    none answers or the broker is unreachable. Workers of other sites on the same broker but
    other queues are not counted."""
    queue = app.conf.task_default_queue
    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception:  # noqa: BLE001 (broker down or refusing: no worker can be reached either)
        return 0
    return sum(1 for queues in replies.values() if any(q.get("name") == queue for q in queues or ()))


def cached_queue_workers() -> int:
    """``queue_workers`` cached (per queue) in Django's cache for ``WORKERS_CACHE_S`` seconds,
    ``NO_WORKERS_CACHE_S`` when the answer is 0."""
    from django.core.cache import cache

    key = f"tenzro:celery-workers:{app.conf.task_default_queue}"
    n = cache.get(key)
    if n is None:
        n = queue_workers()
        cache.set(key, n, WORKERS_CACHE_S if n else NO_WORKERS_CACHE_S)
    return n
