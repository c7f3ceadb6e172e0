"""Celery tasks of ``prepare`` (thin: look up the job, call the service; idempotent)."""
from __future__ import annotations

from celery import shared_task

from prepare import jobs


# acks_late + reject_on_worker_lost: a worker killed mid-job (even SIGKILL) leaves the message
# unacknowledged, so the broker redelivers it and the job resumes from its finished items.
@shared_task(name="prepare.run_job", acks_late=True, reject_on_worker_lost=True)
def run_prepare_job(job_id: str) -> str:
    """Run or resume preparation job ``job_id``; returns its final state."""
    return jobs.run_job(job_id).state
