"""The manual builds without a warning, documents every config key the trainer accepts, and the
README stays short and points at pages that exist.

The site is built once per module with MkDocs' own API in this process (`strict`: a warning, a
broken link or anchor, fails the build); `docs/hooks.py` writes the generated config reference
into the config page while it builds.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from trainer import config_reference
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

mkdocs_config = pytest.importorskip("mkdocs.config")
mkdocs_build = pytest.importorskip("mkdocs.commands.build")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    cfg = mkdocs_config.load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(out))
    mkdocs_build.build(cfg)  # raises mkdocs.exceptions.Abort on any warning in strict mode
    return out


def undocumented(keys: set[str], page_html: str) -> list[str]:
    """The "section.key"s whose row (its anchor and its key) the built config page lacks."""
    text = html.unescape(page_html)
    return sorted(k for k in keys
                  if f'id="{k}"' not in text or f"<code>{k.split('.', 1)[1]}</code>" not in text)


def test_site_builds_strict_with_the_config_page(site):
    assert (site / "index.html").is_file()
    assert (site / "config" / "index.html").is_file()
    page = (site / "config" / "index.html").read_text()
    assert "<!-- config-reference -->" not in page and "<table>" in page, "the hook did not fill the page"


def test_every_accepted_config_key_is_documented(site):
    page = (site / "config" / "index.html").read_text()
    keys = config_reference.accepted_config_keys()
    assert len(keys) > 50 and {"training.seq_len", "parallelism.hardware",
                               "parallelism.data_parallel_shard_degree"} <= keys
    assert not undocumented(keys, page), "keys missing from the config reference"
    # the check would notice a key the page does not have
    assert undocumented(keys | {"training.not_a_key"}, page) == ["training.not_a_key"]


def test_accepted_keys_are_what_the_loader_accepts():
    """Each key, set to its default through a `--section.key=value` override, loads; a key the
    reference does not list is refused."""
    defaults = load_config(None, validate=False).to_dict()
    overrides = []
    for dotted in sorted(config_reference.accepted_config_keys()):
        section, key = dotted.split(".", 1)
        value = defaults[section][key]
        text = "none" if value is None else str(value).lower() if isinstance(value, bool) else \
            "[]" if value == [] else str(value)
        overrides.append(f"--{dotted}={text}")
    load_config(None, overrides, validate=False)
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError):
        load_config(None, ["--training.not_a_key=1"], validate=False)
    assert "parallelism.optimizer" not in config_reference.accepted_config_keys()  # set from [optimizer]


def test_readme_is_short_and_links_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    pages = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)]*)?\)", readme)
    assert len(pages) >= 5, "the README should link the manual's pages"
    missing = [p for p in pages if not (ROOT / p).is_file()]
    assert not missing, f"README links pages that do not exist: {missing}"
