"""``python manage.py prepare_experts --checkpoint DIR_OR_URL --model-id ID``: publish expert and
gate blobs with a progress bar (the job runs in this process; ``--resume JOB`` continues one)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from moe.ranges import RangeError, parse_ranges
from prepare import jobs
from prepare.models import PrepareJob
from prepare.remote import is_url

_MAX_ID = 9_999_999  # the range syntax's 7 digits


def _int_list(text: str | None, flag: str) -> list[int] | None:
    """``"1,3,5-7"`` → [1, 3, 5, 6, 7] (``moe.ranges``); raises ``CommandError`` naming ``flag``."""
    if text is None:
        return None
    try:
        return parse_ranges(text, flag, _MAX_ID)
    except RangeError as exc:  # its message says what is wrong (not a number, lo > hi, a value twice)
        raise CommandError(f"{exc} (expected integers like 1,3,5-7, got {text!r})") from None


def _same_source(given: str, source: str) -> bool:
    """Whether ``--checkpoint`` names a job's ``source`` (the same URL, or the same directory)."""
    if given == source:
        return True
    if is_url(given) or is_url(source):
        return given.rstrip("/") == source.rstrip("/")
    return Path(given).resolve() == Path(source).resolve()


class Command(BaseCommand):
    help = ("Extract (and quantize) a checkpoint's experts and gates into content-addressed blobs, "
            "showing a progress bar. Resumable: --resume JOB_ID skips what a crashed run finished.")

    def add_arguments(self, parser):
        parser.add_argument("--checkpoint", help="checkpoint directory or http(s) URL (Hub repo URLs too)")
        parser.add_argument("--model-id", help="catalog id to publish under")
        parser.add_argument("--layers", help="MoE layers, e.g. 1,2 or 1-4 (default: every MoE layer)")
        parser.add_argument("--experts", help="expert ids, e.g. 0-7,16 (default: all, shared slot included)")
        parser.add_argument("--quant", default=None,
                            help='preset (q4_k_m, q8_0, q4_k, q6_k) or JSON {"gate":..,"up":..,"down":..}')
        parser.add_argument("--revision", default=None, help="branch, tag or commit (Hub URLs)")
        parser.add_argument("--no-gate", action="store_true", help="do not publish the gate blobs")
        parser.add_argument("--resume", default=None, metavar="JOB_ID",
                            help="resume an unfinished job (--checkpoint / --model-id, if given, must match it)")
        parser.add_argument("--replace", action="store_true",
                            help="republish a model id already published with another shape (family, sizes)")
        parser.add_argument("--json", action="store_true", help="print the final status as one JSON line")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    def handle(self, *args, **o):
        if o["resume"]:
            try:
                job_id = uuid.UUID(o["resume"])
            except ValueError:
                raise CommandError(f"--resume: {o['resume']!r} is not a job id (a UUID such as "
                                   f"{uuid.UUID(int=0)})") from None
            try:
                job = PrepareJob.objects.get(job_id=job_id)
            except PrepareJob.DoesNotExist:
                raise CommandError(f"--resume: no preparation job {o['resume']!r}") from None
            if o["model_id"] and o["model_id"] != job.model_id:
                raise CommandError(f"--model-id {o['model_id']!r} does not match job {job.job_id}'s "
                                   f"{job.model_id!r}; drop it or start a new job")
            if o["checkpoint"] and not _same_source(o["checkpoint"], job.source):
                raise CommandError(f"--checkpoint {o['checkpoint']!r} does not match job {job.job_id}'s "
                                   f"{job.source!r}; drop it or start a new job")
        else:
            if not o["checkpoint"]:
                raise CommandError("--checkpoint is required (or --resume JOB_ID)")
            if not o["model_id"]:
                raise CommandError("--model-id is required")
            try:
                job = jobs.create_job(o["checkpoint"], o["model_id"], layers=_int_list(o["layers"], "--layers"),
                                      experts=_int_list(o["experts"], "--experts"), include_gate=not o["no_gate"],
                                      quant=o["quant"], revision=o["revision"], replace=o["replace"])
            except jobs.JobParamError as exc:
                raise CommandError(f"--{exc.field.replace('_', '-')}: {exc}") from None
        self.stderr.write(f"job {job.job_id}: {job.total_experts} experts of {job.model_id}, layers {job.layers}, "
                          f"quant {job.quant or 'dense'}")
        bar = tqdm(total=job.total_experts, unit="expert", disable=o["no_progress"], dynamic_ncols=True)
        bar.n = job.completed_experts + job.failed_experts
        bar.refresh()

        def progress(j: PrepareJob) -> None:
            bar.n = j.completed_experts + j.failed_experts
            bar.set_postfix_str(f"{j.bytes_written / 2**20:.1f} MiB, failed {j.failed_experts}", refresh=False)
            bar.refresh()

        try:
            job = jobs.run_job(job.job_id, progress)
        finally:
            bar.close()
        status = jobs.job_status(job)
        for f in status["failures"]:
            self.stderr.write(f"failed: layer {f['layer']} expert {f['expert']}: {f['error']}")
        for f in status["fallbacks"][:20]:
            self.stderr.write(f"fallback: layer {f['layer']} expert {f['expert']} {f['tensor']}: {f['note']}")
        if o["json"]:
            self.stdout.write(json.dumps(status))
        self.stderr.write(f"job {job.job_id}: {job.state}, {job.completed_experts}/{job.total_experts} experts, "
                          f"{job.bytes_written} bytes")
        if job.state != PrepareJob.State.COMPLETED:
            raise CommandError(job.error or job.state)
