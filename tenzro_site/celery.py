"""The Celery app, configured from Django settings (``CELERY_*``) and discovering ``<app>/tasks.py``."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")

app = Celery("tenzro_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
