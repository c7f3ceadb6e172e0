"""Issue 20: the holder agent runs on a provider's machine without the site's code.

``python -m holders`` joins a running cluster and is listed as connected while its import log
shows no Django ORM and none of the site's apps; and its flag errors still come out (exit 1,
the flag named) where ``django`` cannot be imported at all.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from moe.identity import load_or_create_key, provider_id
from tests.cluster_util import ROOT, env_for, rpc, running_cluster, stop, wait_for
from tests.conftest import QWEN

SITE_PACKAGES = ("django", "registry", "router", "prepare", "settlement", "tenzro_site")


def imported_modules(stderr: str) -> set[str]:
    """Module names of a ``python -X importtime`` log (its ``import time: ... | name`` lines)."""
    return {m.group(1) for m in re.finditer(r"^import time:[^|]*\|[^|]*\|\s*(\S+)\s*$", stderr, re.M)}


def site_modules(modules: set[str]) -> list[str]:
    """The modules among ``modules`` that belong to the site: Django (``django.db`` included), the
    site's apps, and any ``*.models`` module, except numba's type data model
    (``numba.core.datamodel.models``, which the CPU backend's JIT imports; no ORM)."""
    return sorted(m for m in modules
                  if m.split(".")[0] in SITE_PACKAGES
                  or (m.endswith(".models") and m.split(".")[0] != "numba"))


@pytest.mark.cluster
def test_python_m_holders_joins_a_cluster_without_importing_the_site(tmp_path):
    key_path = tmp_path / "standalone.key"
    provider = provider_id(load_or_create_key(key_path))
    env = env_for(tmp_path)
    with running_cluster(tmp_path, [QWEN], holders=1, env=env) as (info, _):
        err_path = tmp_path / "standalone.stderr"
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "holders", "--site", info["url"],
                                     "--key", str(key_path), "--blob-dir", str(tmp_path / "standalone-blobs"),
                                     "--name", "standalone", "--heartbeat-interval", "2"],
                                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
            def connected():
                if proc.poll() is not None:
                    pytest.fail(f"the agent exited ({proc.returncode}): {err_path.read_text()[-3000:]}")
                listed = rpc(info["rpc"], "tenzro_moeListProviders", {})["result"]["providers"]
                return any(p["provider"] == provider and p["connected"] for p in listed)

            try:
                wait_for(connected, 120, "the standalone agent listed as connected")
            finally:
                stop(proc, 20)
    log = err_path.read_text()
    modules = imported_modules(log)
    assert {"holders.cli", "holders.agent", "holders.session", "moe.runtime"} <= modules  # the log is read right
    assert "django.db" not in modules
    assert site_modules(modules) == []
    assert "Traceback" not in log


def test_flag_errors_come_out_without_django(tmp_path):
    """``--key`` in a directory that does not exist: exit 1, the flag named, with ``django``
    unimportable (as on a provider's machine without the site's packages)."""
    key = tmp_path / "missing" / "k"
    code = ("import sys; sys.modules['django'] = None; from holders.cli import main; "
            f"sys.exit(main(['--site', 'http://127.0.0.1:1', '--key', {str(key)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "--key" in done.stderr and "Traceback" not in done.stderr
    assert not key.parent.exists()  # a mistyped path mints no identity


@pytest.mark.parametrize("flags, says", [(["--budget", "-5"], "--budget"), (["--blas-threads", "0"], "--blas-threads"),
                                          (["--http-port", "70000"], "--http-port")])
def test_a_refused_flag_mints_no_key(tmp_path, flags, says):
    """A command refused for any flag exits 1 naming it before the key file is created: the
    provider fixes the flag and starts with the identity it meant to (no stray key on disk)."""
    key = tmp_path / "k"
    code = ("from holders.cli import main; import sys; "
            f"sys.exit(main(['--site', 'http://127.0.0.1:1', '--key', {str(key)!r}] + {flags!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert not key.exists() and "created a new key" not in done.stderr


def test_site_modules_names_the_orm_and_the_apps_only():
    log = "\n".join(f"import time:        1 |          1 | {'  ' * (i % 3)}{m}" for i, m in enumerate(
        ["numba.core.datamodel.models", "httpx._models", "moe.runtime", "registry.models", "django.db",
         "tenzro_site", "foo.models"]))
    assert site_modules(imported_modules(log)) == ["django.db", "foo.models", "registry.models", "tenzro_site"]
