"""MkDocs hooks (`hooks:` in mkdocs.yml): the config reference is generated at build time.

`docs/config.md` holds a placeholder; `on_page_markdown` replaces it with
`trainer.config_reference.render_config_reference()`, the tables of every key the trainer's
config loader accepts, so the page cannot drift from `trainer/config.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "<!-- config-reference -->"
CONFIG_PAGE = "config.md"


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.src_uri != CONFIG_PAGE:
        return markdown
    if PLACEHOLDER not in markdown:
        raise PluginError(f"docs/{CONFIG_PAGE} lost its placeholder {PLACEHOLDER!r}: the config reference "
                          "has nowhere to go")
    if str(ROOT) not in sys.path:  # the project, when it is not installed
        sys.path.insert(0, str(ROOT))
    from trainer.config_reference import render_config_reference

    return markdown.replace(PLACEHOLDER, render_config_reference())
