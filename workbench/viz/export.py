"""HTML that plotly wrote: made self-contained, and read back as a figure."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Union

import plotly.graph_objects as go


_SCRIPT_SRC = re.compile(r"""<script([^>]*?)\ssrc=["']([^"':]+?)["']([^>]*)>\s*</script>""", re.IGNORECASE)


def self_contained_html(html: str, folder: Union[str, Path]) -> str:
    """An HTML figure with the scripts it loads by a relative path written into the page.

    ``fig.write_html(..., include_plotlyjs="directory")`` (what the experiments write) loads
    ``plotly.min.js`` from next to the file; shown from a string (an iframe's ``srcdoc``),
    the page has no directory and draws nothing. Each ``<script src="NAME">`` naming a
    file directly in ``folder`` is inlined; ``plotly.min.js`` missing there is plotly's own
    bundle. Absolute URLs, other paths, and paths that leave ``folder`` are left as they are.
    """
    folder = Path(folder)

    def inline(match: re.Match) -> str:
        before, name, after = match.groups()
        if "/" in name or "\\" in name or name.startswith("."):
            return match.group(0)
        path = folder / name
        if path.is_file() and not path.is_symlink():
            code = path.read_text(encoding="utf-8", errors="replace")
        elif name == "plotly.min.js":
            from plotly.offline import get_plotlyjs

            code = get_plotlyjs()
        else:
            return match.group(0)
        # A script body ends at the first "</script"; escape any inside the code so it stays whole.
        code = re.sub(r"</(script)", r"<\\/\1", code, flags=re.IGNORECASE)
        return f"<script{before}{after}>{code}</script>"

    return _SCRIPT_SRC.sub(inline, html)


def figure_from_html(html: str) -> Optional[go.Figure]:
    """The figure inside an HTML file plotly wrote (``fig.write_html``), or None when the page
    holds anything other than exactly one ``Plotly.newPlot`` call with literal JSON arguments.

    A page can then draw the figure natively (in its own theme, without loading plotly.js
    a second time) and fall back to ``self_contained_html`` in an iframe for anything else.
    """
    calls = [m.end() for m in re.finditer(r"Plotly\.newPlot\(", html)]
    if len(calls) != 1:
        return None
    decoder, at, args = json.JSONDecoder(), calls[0], []
    try:
        for _ in range(3):  # the div id, the data, the layout
            while html[at] in " \t\r\n,":
                at += 1
            value, at = decoder.raw_decode(html, at)
            args.append(value)
        _, data, layout = args
        if not isinstance(data, list) or not isinstance(layout, dict):
            return None
        return go.Figure(data=data, layout=layout)
    except (ValueError, IndexError, TypeError):  # not literal JSON there, or not a figure plotly accepts
        return None
