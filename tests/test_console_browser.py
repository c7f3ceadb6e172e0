"""Operator console in a real browser: Playwright (pytest-playwright) driving Debian's chromium.

Flows: log in; create and vote a proposal until the policy in force changes; watch a real
preparation job's progress advance without reloading; click a heatmap cell to see its
holders; every page without console errors and without a 5xx for odd query strings.
Screenshots of every page go to ``var/console-screenshots/``.

The page talks to pytest-django's ``live_server`` (a thread of this process sharing the
test database). Playwright's sync API keeps an event loop running in the main thread, so
Django's async-safety check is lifted for these tests and ``conftest`` runs them last.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from nacl.signing import SigningKey

from prepare.jobs import create_job, run_job
from registry import governance
from registry.heartbeat import ingest
from registry.models import Provider
from tests.conftest import QWEN, holding, signed_heartbeat

CHROMIUM = shutil.which("chromium") or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium") or None
SHOTS = Path(settings.BASE_DIR) / "var" / "console-screenshots"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed here (apt-get install "
                                                "chromium); .ci/run installs it, so CI runs these tests"),
]

try:  # the assertions auto-wait (polling the DOM) up to their timeout
    from playwright.sync_api import expect
    expect.set_options(timeout=30_000)
except ImportError:  # pragma: no cover - requirements-test.txt pins playwright
    expect = None


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright's launch options, pointed at the system chromium (no downloaded build)."""
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": ["--no-sandbox"]}


@pytest.fixture(scope="session", autouse=True)
def _orm_next_to_playwright():
    """Allow ORM calls in the main thread while Playwright's loop runs there (these tests run
    last, so the rest of the suite keeps Django's async-safety check)."""
    old = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    if old is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = old


@pytest.fixture
def site(live_server, transactional_db):
    """The live site's base URL (a server thread of this process on the test database)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    return live_server.url


@pytest.fixture
def console_errors(page):
    """Console errors and uncaught page errors seen by ``page`` (must stay empty)."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    return errors


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def login(page, site: str, username: str) -> None:
    page.goto(f"{site}/login/?next=/governance/")
    page.fill("#id_username", username)
    page.fill("#id_password", "pw-" + username)
    page.click("button[type=submit]")
    expect(page.locator("#whoami")).to_contain_text(username)


def staff_user(name: str):
    return get_user_model().objects.create_user(name, password="pw-" + name, is_staff=True)


def live_holders() -> None:
    """Two live providers over model ``m``: gpu-a holds l0-1/e0-3, cpu-b holds l0/e0-1 Cold."""
    ka, kb = SigningKey(bytes([7]) * 32), SigningKey(bytes([8]) * 32)
    ingest(signed_heartbeat(ka, [holding("m", layer, e, committed_tps=1500) for layer in (0, 1) for e in range(4)],
                            name="gpu-a", moe_gpu=True))
    ingest(signed_heartbeat(kb, [holding("m", 0, e, residency="Cold") for e in range(2)], name="cpu-b"))
    Provider.objects.update(connected=True)


def test_login_propose_vote_and_see_the_policy_change(site, page, browser, console_errors):
    staff_user("alice")
    staff_user("bob")  # electorate: operator, user:alice, user:bob → quorum 2
    page.goto(f"{site}/governance/")
    expect(page.locator("#proposal-form")).to_have_count(0)  # anonymous: read only
    login(page, site, "alice")
    shot(page, "governance-logged-in")
    # A change the policy in force refuses is shown on its field and creates nothing.
    page.fill("#id_title", "too many")
    page.fill("#id_min_replication", "9")
    page.click("#proposal-form button[type=submit]")
    expect(page.locator("#proposal-form .errorlist")).to_contain_text("must be >= min_replication")
    shot(page, "governance-form-error")
    # The refused form answers 400 (chromium logs that status); nothing else may be logged.
    assert [e for e in console_errors if "status of 400" not in e] == []
    console_errors.clear()
    page.fill("#id_title", "one copy is enough")
    page.fill("#id_min_replication", "1")
    page.click("#proposal-form button[type=submit]")
    expect(page.locator(".messages")).to_contain_text("opened")
    row = page.locator("#proposals tbody tr").first
    expect(row).to_contain_text("min_replication = 1")
    row.locator("button[name=vote-yes]").click()
    expect(page.locator("#proposals tbody tr").first).to_contain_text("1 / 2 yes")
    expect(page.locator('#policy td[data-field="min_replication"]')).to_have_text("2")
    # Bob, in his own browser session, casts the deciding vote.
    bob = browser.new_context().new_page()
    login(bob, site, "bob")
    bob.locator("#proposals tbody tr").first.locator("button[name=vote-yes]").click()
    expect(bob.locator("#proposals tbody tr").first).to_contain_text("Applied")
    expect(bob.locator('#policy td[data-field="min_replication"]')).to_have_text("1")
    expect(bob.locator("#policy-version")).to_have_text("v2")
    expect(bob.locator("#audit")).to_contain_text("applied")
    shot(bob, "governance-applied")
    bob.context.close()
    assert governance.policy_json()["min_replication"] == 1
    assert console_errors == []


def test_prepare_job_progress_advances_without_reload(site, page, console_errors):
    job = create_job(str(QWEN), "qwen-browser", layers=[0], experts=[0, 1, 2, 3], include_gate=False)
    page.goto(f"{site}/prepare/{job.job_id}")
    expect(page.locator("#job-count")).to_have_text("0 / 4")
    page.evaluate("window.__sameDocument = true")  # gone if the page reloads
    seen = []

    def watch(j) -> None:
        """Called by the job after every expert: the open page must catch up by polling."""
        expect(page.locator("#job-count")).to_have_text(f"{j.completed_experts} / 4")
        seen.append(j.completed_experts)
        if j.completed_experts == 2:
            shot(page, "prepare-job-running")

    run_job(job.job_id, progress=watch)
    assert seen == [1, 2, 3, 4]
    expect(page.locator("#job-state")).to_have_text("completed")
    assert page.evaluate("window.__sameDocument") is True
    shot(page, "prepare-job-completed")
    page.goto(f"{site}/prepare/")
    expect(page.locator("#job-rows")).to_contain_text("qwen-browser")
    shot(page, "prepare-jobs")
    assert console_errors == []


def test_coverage_click_shows_holders(site, page, console_errors):
    live_holders()
    page.goto(f"{site}/coverage/m")
    page.locator('#heatmap td[data-l="0"][data-e="1"]').click()
    expect(page.locator("#holders")).to_contain_text("layer 0 / expert 1")
    expect(page.locator("#holders")).to_contain_text("gpu-a")
    expect(page.locator("#holders")).to_contain_text("cpu-b")
    expect(page.locator("#under")).to_contain_text("1")
    shot(page, "coverage")
    assert console_errors == []


ODD = ["", "?status=Nope", "?live=maybe&role=%00", "?layer=-1&expert=x", "?%ff=%fe&a[]=1",
       "?status=Open&status=Applied&next=javascript:alert(1)"]


def test_every_page_no_console_errors_and_no_5xx(site, page, console_errors):
    live_holders()
    create_job(str(QWEN), "qwen-pages", layers=[0], experts=[0])
    provider = Provider.objects.get(name="gpu-a").provider
    pages = {"overview": "/", "governance": "/governance/", "providers": "/providers/",
             "provider": f"/providers/{provider}", "coverage-index": "/coverage/", "coverage-m": "/coverage/m",
             "prepare": "/prepare/", "serving": "/serving/", "login": "/login/"}
    for name, path in pages.items():
        for q in ODD:
            resp = page.goto(site + path + q)
            assert resp.status < 500, (path, q, resp.status)
            assert resp.status == 200, (path, q, resp.status)
            expect(page.locator("header.top nav")).to_be_visible()
        page.goto(site + path)
        shot(page, name)
    # Fragments and unknown ids answer 4xx with a message, never 5xx.
    for path in ["/coverage/m/holders?layer=x", "/providers/" + "f" * 64, "/prepare/" + "0" * 8 + "-0000-0000-0000-"
                 + "0" * 12 + "/progress"]:
        resp = page.request.get(site + path)
        assert 400 <= resp.status < 500, (path, resp.status)
    assert console_errors == [], console_errors
    assert re.search(r"Tenzro", page.title())


def chart_text_problems(page) -> list[str]:
    """Texts of the page's SVG charts drawn outside their chart or over its title (issue 24 item 15:
    value labels of full-height bars sat on the title; the last minute label was cut)."""
    return page.evaluate("""() => {
        const out = [];
        for (const svg of document.querySelectorAll("svg.chart")) {
            const box = svg.getBoundingClientRect();
            const texts = [...svg.querySelectorAll("text")];
            const title = texts[0].getBoundingClientRect();
            for (const t of texts) {
                const r = t.getBoundingClientRect();
                if (r.left < box.left - 0.5 || r.right > box.right + 0.5) out.push("outside: " + t.textContent);
                if (t !== texts[0] && r.top < title.bottom - 0.5 && r.right > title.left && r.left < title.right)
                    out.push("over the title: " + t.textContent);
            }
        }
        return out;
    }""")


def economy_records() -> dict:
    """Receipts, settlements through the real services (see ``tests.test_console.economy``):
    an honest and a lying holder, every batch kept and settled."""
    from tests.test_console import make_economy

    return make_economy()


def test_dispute_a_receipt_as_staff_and_filter_receipts(site, page, console_errors):
    honest, liar, keys = economy_records()
    staff_user("alice")
    page.goto(f"{site}/receipts/")
    expect(page.locator("#receipts tbody tr")).to_have_count(3)
    page.fill("#id_provider", liar)
    page.click("#receipt-filter button[type=submit]")
    expect(page.locator("#receipts tbody tr")).to_have_count(1)
    expect(page.locator("#receipts")).to_contain_text("liar-l")
    shot(page, "receipts-filtered")
    page.locator("#receipts tbody tr a").first.click()
    expect(page.locator("#signature-status")).to_contain_text("valid")
    expect(page.locator("#dispute-form")).to_have_count(0)  # anonymous: read only
    login(page, site, "alice")
    page.goto(f"{site}/receipts/{keys['liar'][0]}")
    page.evaluate("window.__sameDocument = true")
    page.click("#dispute-form button[name=dispute]")
    expect(page.locator("#dispute-outcome")).to_contain_text("upheld")
    expect(page.locator(".messages")).to_contain_text("fraud proof issued")
    expect(page.locator("#dispute")).to_contain_text("fraud proof")
    assert page.evaluate("window.__sameDocument") is True  # htmx swapped the page in place
    shot(page, "receipt-disputed")
    page.goto(f"{site}/disputes/")
    expect(page.locator("#disputes")).to_contain_text("upheld")
    expect(page.locator("#audits")).to_contain_text("No automatic audit matches.")
    shot(page, "disputes")
    # An automatic audit that passed: listed apart, and staff can still dispute the receipt.
    from concurrent.futures import ThreadPoolExecutor

    from asgiref.sync import async_to_sync

    from settlement import services
    with ThreadPoolExecutor(1) as pool:  # Playwright's loop runs in this thread
        pool.submit(async_to_sync(services.audit), keys["honest"][0]).result()
    page.goto(f"{site}/disputes/")
    expect(page.locator("#audits")).to_contain_text("audit passed")
    expect(page.locator("#disputes")).not_to_contain_text("audit passed")
    page.goto(f"{site}/receipts/{keys['honest'][0]}")
    expect(page.locator("#dispute-outcome")).to_contain_text("automatic audit")
    page.click("#dispute-form button[name=dispute]")
    expect(page.locator("#dispute-outcome")).to_contain_text("operator's dispute")
    expect(page.locator(".messages")).to_contain_text("dispute rejected")
    assert console_errors == [], console_errors


def test_economy_pages_no_console_errors_and_no_5xx(site, page, console_errors):
    honest, liar, keys = economy_records()
    pages = {"receipts": "/receipts/", "receipt": f"/receipts/{keys['honest'][0]}", "disputes": "/disputes/",
             "settlements": "/settlements/", "provider-economy": f"/providers/{honest}"}
    odd = ODD + ["?model=%00&provider=zz&layer=-1&expert=x", "?forward=%ff&outcome=maybe"]
    for name, path in pages.items():
        for q in odd:
            resp = page.goto(site + path + q)
            assert resp.status == 200, (path, q, resp.status)
            expect(page.locator("header.top nav")).to_be_visible()
        page.goto(site + path)
        shot(page, name)
    expect(page.locator("#provider-settlements tbody tr, #provider-settlements tr")).not_to_have_count(0)
    page.goto(f"{site}/settlements/")
    expect(page.locator("svg.chart")).to_be_visible()
    assert chart_text_problems(page) == []
    expect(page.locator("#per-provider")).to_contain_text("honest-h")
    resp = page.request.get(f"{site}/settlements.csv?provider={honest}")
    assert resp.status == 200 and resp.text().count("\n") == 3  # header + two settlements
    assert page.request.get(f"{site}/settlements.csv?provider=zz").status == 400
    assert page.request.get(f"{site}/receipts/moe_receipt:nope").status == 404
    from concurrent.futures import ThreadPoolExecutor

    from asgiref.sync import async_to_sync

    from settlement import services
    with ThreadPoolExecutor(1) as pool:  # a reputation chart at full height (Playwright's loop runs here)
        pool.submit(async_to_sync(services.audit), keys["liar"][0]).result()
    page.goto(f"{site}/providers/{liar}")
    expect(page.locator("svg.chart")).to_be_visible()
    assert chart_text_problems(page) == []
    shot(page, "provider-reputation-chart")
    assert console_errors == [], console_errors


def test_serving_charts_update_without_reload(site, page, console_errors):
    from router.apps import install
    from router.state import Router

    router = Router()  # fresh metrics: the page starts from zero
    previous = install(router)
    try:
        page.goto(f"{site}/serving/")
        expect(page.locator("header.top nav a.current")).to_have_text("Serving")
        panel = page.locator("#serving-panel")
        expect(panel).to_have_attribute("data-tokens", "0")
        page.evaluate("window.__sameDocument = true")  # gone if the page reloads
        m = router.metrics
        m.running.labels("q").set(2)
        m.tokens.labels("q").inc(48)
        for _ in range(48):
            m.itl.labels("q").observe(0.03)
        m.holder_outcomes([], {"holder-a": [15.0, 25.0]})
        expect(panel).to_have_attribute("data-tokens", "48")
        expect(page.locator("svg[aria-label='Output tokens/s'] polyline")).not_to_have_count(0)
        expect(page.locator("#serving-holders")).to_contain_text("holder-a")
        assert page.evaluate("window.__sameDocument") is True
        shot(page, "serving")
    finally:
        install(previous)
    assert console_errors == []
