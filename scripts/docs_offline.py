"""mkdocs hook (mkdocs.yml `hooks:`): the built site draws its figures with no internet.

Many readers open the site on machines without internet (clusters, air-gapped labs), where a
script loaded from a CDN leaves every tutorial figure blank. After the build this hook:

- copies plotly.js from the installed `plotly` package (plotly/package_data/plotly.min.js, the
  same file `fig.write_html(include_plotlyjs="directory")` writes) to assets/offline/;
- points every page at it: the require.js path the tutorials' `notebook_connected` renderer
  configures, and the `<script src>` of the standalone figure pages (docs/*.html,
  docs/grokking/*.html, written by scripts/ with plotly loaded from its CDN to keep them small);
- points mkdocs-jupyter's require.js at docs/assets/offline/require.js (RequireJS 2.3.7, MIT,
  vendored from npm: no Python package ships it);
- fails the build if any page still loads a script or stylesheet from another host.

MathJax: no page loads it. The tutorials have no math, mkdocs-jupyter's MathJax url is left empty
(`<script src="">`, which a browser does not fetch) and no markdown extension renders math; the
last check above fails the build if one ever loads it from a CDN. mkdocs-jupyter's mermaid loader
imports mermaid from a CDN only on a page with a mermaid diagram, and no tutorial has one.

The rewrite runs on the written files (`on_post_build`), not on the page text, so pages served
from mkdocs-jupyter's execution cache (.cache/) are rewritten too.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from mkdocs.exceptions import PluginError

OFFLINE = "assets/offline"
# `requirejs.config({paths: {'plotly': ['https://cdn.plot.ly/plotly-4.1.1.min']}})`: require.js adds the .js
PLOTLY_REQUIRE_PATH = re.compile(r"""(['"])https://cdn\.plot\.ly/plotly[\w.\-]*?\.min\1""")
# `<script charset="utf-8" src="https://cdn.plot.ly/plotly-4.1.1.min.js" integrity="sha256-..." crossorigin="anonymous">`
PLOTLY_SCRIPT = re.compile(r"""<script([^>]*?)\ssrc=(['"])https://cdn\.plot\.ly/plotly[\w.\-]*?\.js\2([^>]*)>""")
REQUIRE_SCRIPT = re.compile(r"""<script([^>]*?)\ssrc=(['"])https://[^'"]*/require(?:\.min)?\.js\2([^>]*)>""")
# integrity and crossorigin make the browser fetch with CORS, which a file:// page cannot do
CORS_ATTRS = re.compile(r"""\s(?:integrity|crossorigin)(?:=(['"]).*?\1)?""")
# what must not remain: a script, a stylesheet or a require.js path on another host
EXTERNAL = [re.compile(r"""<script[^>]*\ssrc=['"](?:https?:)?//[^'"]+['"]"""),
            re.compile(r"""<link[^>]*\srel=['"]stylesheet['"][^>]*\shref=['"](?:https?:)?//[^'"]+['"]"""),
            re.compile(r"""<link[^>]*\shref=['"](?:https?:)?//[^'"]+['"][^>]*\srel=['"]stylesheet['"]"""),
            re.compile(r"""paths:\s*\{[^}]*['"](?:https?:)?//[^'"]+['"]""")]


def plotly_js() -> Path:
    """plotly.min.js as the installed plotly package ships it."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _script(match: re.Match, src: str) -> str:
    return f'<script{CORS_ATTRS.sub("", match.group(1))} src="{src}"{CORS_ATTRS.sub("", match.group(3))}>'


def make_offline(html: str, prefix: str) -> str:
    """``html`` with plotly.js and require.js loaded from ``prefix`` + assets/offline/ (``prefix``:
    the path from the page's folder to the site root, "" or ending in "/")."""
    html = PLOTLY_REQUIRE_PATH.sub(lambda m: f"{m.group(1)}{prefix}{OFFLINE}/plotly.min{m.group(1)}", html)
    html = PLOTLY_SCRIPT.sub(lambda m: _script(m, f"{prefix}{OFFLINE}/plotly.min.js"), html)
    return REQUIRE_SCRIPT.sub(lambda m: _script(m, f"{prefix}{OFFLINE}/require.js"), html)


def external_loads(html: str) -> list[str]:
    """Every script, stylesheet or require.js path ``html`` still loads from another host."""
    return [m.group(0)[:160] for pattern in EXTERNAL for m in pattern.finditer(html)]


def on_post_build(config, **kwargs) -> None:
    site = Path(config["site_dir"])
    (site / OFFLINE).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_js(), site / OFFLINE / "plotly.min.js")
    problems = []
    for path in sorted(site.rglob("*.html")):
        text = path.read_text(encoding="utf-8")
        prefix = os.path.relpath(site, path.parent).replace(os.sep, "/") + "/"
        new = make_offline(text, "" if prefix == "./" else prefix)
        if new != text:
            path.write_text(new, encoding="utf-8")
        problems += [f"{path.relative_to(site)}: {load}" for load in external_loads(new)]
    if problems:
        raise PluginError("pages load from the internet, blank offline (scripts/docs_offline.py):\n  "
                          + "\n  ".join(problems))
