"""The user guide (issue 42): it builds with ``mkdocs build --strict`` (a broken link, a missing page or a page left
out of the nav fails), the generated pages match the code they come from (the serve flags, ``envs.py``), and the
README stays short, with working links and the quickstarts on its first screen."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Pages the README may link to before the work that writes them is merged (empty: every link is checked).
COMING: set[str] = set()


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mkdocs_build_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "serving" / "index.html").is_file()


def test_mkdocs_strict_catches_a_broken_link(tmp_path):
    """The check above can fail: the same configuration on a copy of docs/ with one broken link aborts."""
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "offline.md").write_text((docs / "offline.md").read_text() + "\n[gone](no-such-page.md)\n")
    cfg = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(cfg)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr


def test_generated_pages_match_the_code():
    """docs/environment-variables.md and serving.md's flag table are what scripts/gen_docs.py makes now: a new flag
    or environment variable fails here until `python scripts/gen_docs.py` is run."""
    for path, text in _gen_docs().expected().items():
        assert path.read_text() == text, f"{path.name} is out of date: run python scripts/gen_docs.py"


def test_every_serve_flag_is_in_the_flag_table():
    """Independent of the generator: each option string of the real `serve` parser appears in serving.md."""
    import argparse

    from tinyvllm.entrypoints import cli

    parser = cli.build_parser(["serve"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    page = (ROOT / "docs" / "serving.md").read_text()
    flags = [o for a in sub.choices["serve"]._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert len(flags) > 20
    assert [f for f in flags if f"`{f}`" not in page] == []


def test_an_undocumented_environment_variable_fails_the_generator(monkeypatch):
    from tinyvllm import envs

    monkeypatch.setitem(envs._VARS, "TINYVLLM_NEW_KNOB", lambda: 1)
    with pytest.raises(SystemExit, match="TINYVLLM_NEW_KNOB"):
        _gen_docs().env_page()


def test_readme_is_short_links_resolve_and_quickstarts_are_on_the_first_screen():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, len(lines)
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [ln for ln in links if not ln.startswith(("http://", "https://", "mailto:"))]
    assert [ln for ln in local if not (ROOT / ln).exists() and ln not in COMING] == []
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for a in re.findall(r"\]\(#([^)]+)\)", text):
        assert a in anchors, a
    first_screen = "\n".join(lines[:40]).lower()
    assert "](#tools" in first_screen and "](#kv-offload" in first_screen, "tools/offload quickstarts not linked"
    for cmd in ("make serve", "make test"):
        assert cmd in first_screen
