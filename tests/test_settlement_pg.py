"""Settlement exactly once on PostgreSQL: two worker processes racing over the same pending
settlements (each also retrying every forward) pay each (forward_id, provider) once."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.cluster_util import ROOT, env_for, fresh_postgres_db
from tests.conftest import PG_URL, needs_services

pytestmark = [pytest.mark.services, needs_services]

SEED = """
from registry.models import Provider
from settlement.models import Settlement
for i in range(3):
    Provider.objects.create(provider=f"{i:064x}", price_per_input_token=10 + i, minimum_price=100)
Settlement.objects.bulk_create([Settlement(forward_id=f"f{j:04d}", provider=f"{j % 3:064x}", model_id="m",
                                           tokens=1 + j % 17, batches=1, commitments_digest="00" * 32,
                                           created_ms=0) for j in range(300)])
"""

WORKER = """
import time
from settlement import tasks
from settlement.models import Settlement
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.005)
paid = tasks.settle_pending()  # the beat sweep ...
for f in sorted(set(Settlement.objects.values_list("forward_id", flat=True))):
    paid += tasks.settle_forward(f)  # ... and every forward's task retried
print("PAID", paid)
"""

CHECK = """
from django.db.models import Sum
from registry.models import Provider
from settlement.models import Settlement
from settlement.services import price
assert not Settlement.objects.filter(state="pending").exists()
for p in Provider.objects.all():
    rows = Settlement.objects.filter(provider=p.provider)
    want = sum(price(s.tokens, p.price_per_input_token, p.minimum_price, 9000)[1] for s in rows)
    assert p.balance == want == rows.aggregate(s=Sum("holder_amount"))["s"], (p.balance, want)
    assert p.reputation == 500 + rows.count(), p.reputation
print("CHECK OK")
"""


def manage(env, *args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_two_workers_and_retries_pay_each_settlement_once(tmp_path):
    import time

    with fresh_postgres_db(PG_URL) as url:
        env = env_for(tmp_path, database_url=url)
        assert manage(env, "migrate", "-v", "0").returncode == 0
        r = manage(env, "shell", "-c", SEED)
        assert r.returncode == 0, r.stderr
        # Both start at the same instant (manage.py shell -c takes no argv: the time is inlined).
        worker = textwrap.dedent(WORKER).replace("float(sys.argv[1])", f"float({time.time() + 4})")
        workers = [subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "shell", "-c", worker], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for _ in range(2)]
        outs = [w.communicate(timeout=300) for w in workers]
        assert all(w.returncode == 0 for w in workers), [o[1][-2000:] for o in outs]
        paid = [int(o[0].split("PAID")[1]) for o in outs]
        assert sum(paid) == 300, paid
        r = manage(env, "shell", "-c", CHECK)
        assert r.returncode == 0 and "CHECK OK" in r.stdout, r.stderr[-3000:]
