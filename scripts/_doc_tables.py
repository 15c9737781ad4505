"""What the scripts that regenerate a documented table and its figure share: ``--check`` (every
documented row measured again to the printed digits) and the figure page."""

from __future__ import annotations

import re
from pathlib import Path


def check_rows(doc: Path, measured: str) -> int:
    """0 when every row of ``doc``'s table (lines ``| <step> | ...``) is a line of ``measured``, else 1
    (also 1 when ``doc`` has no such row), printing which no longer hold."""
    documented = [line for line in doc.read_text().splitlines() if re.match(r"^\| \d+ \|", line)]
    stale = [line for line in documented if line not in measured.splitlines()]
    print(f"{len(documented) - len(stale)} of {len(documented)} documented rows measured again")
    for line in stale:
        print("  no longer holds:", line)
    return 1 if stale or not documented else 0


def write_page(path: Path, title: str, body: str) -> None:
    """An HTML page of figures (``body``: their ``to_html`` fragments) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<html><head><meta charset='utf-8'><title>{title}</title></head><body>{body}</body></html>\n")
