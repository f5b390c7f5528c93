"""The dashboard page: one HTML document with its CSS and JavaScript inlined.

The three files live apart in `static/` (readable, lintable) and are joined when served,
so the page is a single self-contained response -- no CDN, no second request, and a saved
copy still works against a live server.  Shipped as package data (pyproject.toml).
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.lru_cache(maxsize=1)
def render_page() -> str:
    static = resources.files("tokenloom.dashboard") / "static"
    html = (static / "dashboard.html").read_text(encoding="utf-8")
    css = (static / "dashboard.css").read_text(encoding="utf-8")
    js = (static / "dashboard.js").read_text(encoding="utf-8")
    # Neither file may close its own element early.
    assert "</style" not in css and "</script" not in js
    return html.replace("/*@CSS@*/", css).replace("/*@JS@*/", js)
