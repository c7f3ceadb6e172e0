"""The project's own design document (issue 24 item 14): code, README and API docs cited
"DESIGN §6/§7" and "DESIGN.md of the shared folder", which a clone does not have."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "DESIGN.md"
SKIP = {".git", "var", "node_modules"}


def _project_files():
    """The checkout's own files: tracked or new, not what .gitignore leaves out (the venvs,
    ``make bench``'s aiperf venv and llama.cpp sources, build dirs); every file under ROOT
    outside ``SKIP`` and ``.venv*`` where git cannot say."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        return [p for p in ROOT.rglob("*") if not SKIP & set(p.relative_to(ROOT).parts)
                and not any(part.startswith(".venv") for part in p.relative_to(ROOT).parts)]


def sources():
    for path in _project_files():
        if path.suffix in {".py", ".md", ".html"} and path not in (DESIGN, Path(__file__).resolve()) \
                and path.is_file():
            yield path


def test_every_design_citation_names_the_shipped_doc_and_an_existing_section():
    sections = set(re.findall(r"^## §(\d+)", DESIGN.read_text(), re.M))
    assert sections >= {"1", "2", "3", "4", "5", "6", "7", "8"}
    bad, cited = [], set()
    for path in sources():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in re.finditer(r"DESIGN", line):
                if not line[:m.start()].endswith("docs/") or "shared folder" in line:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
            cited |= set(re.findall(r"docs/DESIGN\.md`{0,2} §(\d+)", line))
    assert not bad, "\n".join(bad)
    assert cited and cited <= sections, cited - sections


def test_readme_and_api_docs_point_at_the_doc(client):
    assert "docs/DESIGN.md" in (ROOT / "README.md").read_text()
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").content.decode()
    assert "docs/DESIGN.md" in schema and "shared folder" not in schema
