"""Project wiring of the Tenzro distributed MoE site; loads the Celery app with Django."""
from tenzro_site.celery import app as celery_app

__all__ = ["celery_app"]
