"""Docs and discoverability (issue 15 item 12): the OpenAPI page names the operator credential,
its description survives Markdown rendering, the README's forward example asks for the exact
carrier, and a model published from a checkpoint is known to ``tenzro_moeCatalogShape``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prepare.services import publish_checkpoint
from tests.conftest import QWEN

README = Path(__file__).resolve().parent.parent / "README.md"


def rpc(client, method, params):
    return client.post("/rpc", json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}),
                       content_type="application/json").json()


@pytest.mark.django_db
def test_openapi_declares_the_operator_scheme_on_operator_endpoints(client):
    schema = client.get("/api/schema/", {"format": "json"}).json()
    scheme = schema["components"]["securitySchemes"]["operatorToken"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer") and "operator_token" in scheme["description"]
    secured = {(m, path) for path, ops in schema["paths"].items() for m, op in ops.items()
               if {"operatorToken": []} in op.get("security", [])}
    assert secured == {("post", "/api/v1/proposals"), ("post", "/api/v1/proposals/{proposal_id}/vote"),
                       ("post", "/api/v1/proposals/{proposal_id}/withdraw"),
                       ("post", "/api/v1/receipts/{key}/dispute")}
    # Swagger UI renders the description as Markdown: an angle bracket outside a code span is an
    # HTML tag to it, and "Bearer <token>" showed as "Bearer ." before.
    description = schema["info"]["description"]
    outside_code = re.sub(r"`[^`]*`", "", description)
    assert "<" not in outside_code and "Bearer <operator token>" in description


def test_readme_forward_example_uses_the_exact_carrier_and_documents_params():
    text = README.read_text()
    example = text[text.index('"method":"tenzro_moeForward"'):][:300]
    assert '"carrier":"f32"' in example
    for needle in ("tenzro_moePlanDispatch {model_id, routings", "tenzro_moeExpertStatus {provider?}",
                   "createsuperuser", "Governance: who votes", "TENZRO_UNPROVEN_PROVIDER_TTL"):
        assert needle in text, needle


def test_every_data_plane_variable_is_in_the_readme():
    """Each ``TENZRO_*`` variable the data plane reads (``moe/``: kernels, compute backends;
    ``holders/``: the agent; ``router/``: the serving path) has a README row;
    TENZRO_KERNEL_ISA, TENZRO_KERNEL_THREADS, TENZRO_QUANT_NATIVE_BATCH and TENZRO_WGPU_CACHE_BYTES
    had none."""
    read = {m for pkg in ("moe", "holders", "router") for f in (README.parent / pkg).rglob("*.py")
            for m in re.findall(r'"(TENZRO_[A-Z0-9_]+)"', f.read_text())}
    assert read and sorted(v for v in read if f"`{v}`" not in README.read_text()) == []


@pytest.mark.django_db
def test_a_model_published_from_a_checkpoint_has_a_catalog_shape(client):
    unknown = rpc(client, "tenzro_moeCatalogShape", {"model_id": "qwen3-moe-tiny"})
    assert unknown["error"]["data"]["field"] == "model_id"
    model = publish_checkpoint(QWEN)
    shape = rpc(client, "tenzro_moeCatalogShape", {"model_id": model.model_id})["result"]
    config = json.loads((QWEN / "config.json").read_text())
    assert shape["model_id"] == model.model_id and shape["is_moe"]
    assert (shape["moe"]["num_experts"], shape["moe"]["experts_per_token"], shape["moe"]["hidden_size"]) == (
        config["num_experts"], config["num_experts_per_tok"], config["hidden_size"])
    assert shape["moe"]["moe_layers_count"] == len(model.moe_layers)
    listed = client.get("/api/v1/catalog").json()["models"]
    assert [m["model_id"] for m in listed].count(model.model_id) == 1
    assert client.get(f"/api/v1/catalog/{model.model_id}").json() == shape


@pytest.mark.django_db(transaction=True)
def test_readme_export_example_runs_as_written(tmp_path):
    """The README's ``export_gguf`` example publishes the model it exports (in the database the
    commands run with), so its commands, run in order, write the file."""
    import shlex

    from django.core.management import call_command

    block = next(b for b in re.findall(r"```\n(.*?)```", README.read_text(), re.S) if "export_gguf --model-id" in b)
    ran = []
    for line in block.splitlines():
        argv = shlex.split(line)
        if argv[:2] != ["python", "manage.py"] or argv[2] not in ("prepare_experts", "export_gguf"):
            continue  # tenzro_cluster of a 30B GGUF: not here
        if argv[2] == "export_gguf":
            argv[argv.index("--out") + 1] = str(tmp_path / "x.gguf")
        else:
            argv.append("--no-progress")
        call_command(*argv[2:])
        ran.append(argv[2])
    assert ran[-1] == "export_gguf" and (tmp_path / "x.gguf").stat().st_size > 0


def test_files_named_in_the_commands_help_exist():
    """A ``--help`` that points at a script names one this checkout has."""
    from django.core.management import get_commands, load_command_class

    root = README.parent
    named = set()
    for name, app in get_commands().items():
        if app.startswith("django") or app in ("rest_framework", "drf_spectacular", "channels", "daphne"):
            continue
        text = load_command_class(app, name).create_parser("manage.py", name).format_help()
        named |= {(name, p) for p in re.findall(r"\b[\w./-]+/[\w.-]+\.py\b", text.replace("\n", " "))}
    assert named, "no command names a file: the pattern is wrong"
    assert not [(n, p) for n, p in named if not (root / p).is_file()], named
