"""mkdocs hook (mkdocs.yml `hooks:`): the built site draws its figures with no internet.

Many readers open the site on machines without internet (clusters, air-gapped labs), where a
script loaded from a CDN leaves every tutorial figure blank. The tutorials draw with plotly's
`notebook_connected` renderer, whose output loads plotly.js from cdn.plot.ly and MathJax (for LaTeX
in figure text) from cdnjs, once per figure; the standalone figure pages (docs/*.html,
docs/grokking/*.html, written by scripts/ with plotly from its CDN to keep them small) load
plotly.js the same way. After the build this hook:

- copies plotly.js from the installed `plotly` package (plotly/package_data/plotly.min.js, the
  file `fig.write_html(include_plotlyjs="directory")` writes, so always the version the figures
  were made for) and MathJax (scripts/vendor/mathjax/tex-svg.js: MathJax 3.2.2's one-file TeX to
  SVG build, Apache-2.0, from npm's `mathjax` package, as no Python package without other baggage
  ships it) to assets/offline/;
- points every page's plotly.js and MathJax loads there, by a path relative to the page, so the
  site works from any folder, over http or from file://;
- fails the build if any page still loads a script or stylesheet from another host.

mkdocs-jupyter's own MathJax url is left empty (`<script src="">`, which a browser does not fetch):
no tutorial has math in its markdown. Its mermaid loader imports mermaid from a CDN only on a page
with a mermaid diagram, and no tutorial has one.

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
MATHJAX = Path(__file__).resolve().parent / "vendor" / "mathjax" / "tex-svg.js"
# `<script type="module">import "https://cdn.plot.ly/plotly-4.1.1.min"</script>` (the renderer's first
# output): made a plain script, which a page opened from disk may load (a module may not, under CORS)
PLOTLY_IMPORT = re.compile(r"""<script\s+type=(['"])module\1>\s*import\s+(['"])https://cdn\.plot\.ly/plotly[\w.\-]*?"""
                           r"""\.min(?:\.js)?\2;?\s*</script>""")
# `<script charset="utf-8" src="https://cdn.plot.ly/plotly-4.1.1.min.js" integrity="sha256-..." crossorigin="anonymous">`
PLOTLY_SCRIPT = re.compile(r"""<script([^>]*?)\ssrc=(['"])https://cdn\.plot\.ly/plotly[\w.\-]*?\.js\2([^>]*)>""")
# `<script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/3.2.2/es5/tex-svg.min.js">`
MATHJAX_SCRIPT = re.compile(r"""<script([^>]*?)\ssrc=(['"])https://[^'"]*mathjax[^'"]*/tex-svg(?:\.min)?\.js\2([^>]*)>""",
                            re.I)
# integrity and crossorigin make the browser fetch with CORS, which a file:// page cannot do
CORS_ATTRS = re.compile(r"""\s(?:integrity|crossorigin)(?:=(['"]).*?\1)?""")
# what must not remain: a script, a stylesheet or a module import from another host
EXTERNAL = [re.compile(r"""<script[^>]*\ssrc=['"](?:https?:)?//[^'"]+['"]"""),
            re.compile(r"""<link[^>]*\srel=['"]stylesheet['"][^>]*\shref=['"](?:https?:)?//[^'"]+['"]"""),
            re.compile(r"""<link[^>]*\shref=['"](?:https?:)?//[^'"]+['"][^>]*\srel=['"]stylesheet['"]"""),
            re.compile(r"""\bimport\s+['"](?:https?:)?//[^'"]+['"]""")]


def plotly_js() -> Path:
    """plotly.min.js as the installed plotly package ships it."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _script(match: re.Match, src: str) -> str:
    return f'<script{CORS_ATTRS.sub("", match.group(1))} src="{src}"{CORS_ATTRS.sub("", match.group(3))}>'


def make_offline(html: str, prefix: str) -> str:
    """``html`` with plotly.js and MathJax loaded from ``prefix`` + assets/offline/, each once
    (``prefix``: the path from the page's folder to the site root, ending in "/")."""
    html = PLOTLY_IMPORT.sub(f'<script charset="utf-8" src="{prefix}{OFFLINE}/plotly.min.js"></script>', html)
    html = PLOTLY_SCRIPT.sub(lambda m: _script(m, f"{prefix}{OFFLINE}/plotly.min.js"), html)
    html = MATHJAX_SCRIPT.sub(lambda m: _script(m, f"{prefix}{OFFLINE}/tex-svg.js"), html)
    for name in ("plotly.min.js", "tex-svg.js"):
        html = _first_only(html, f"{prefix}{OFFLINE}/{name}")
    return html


def _first_only(html: str, src: str) -> str:
    """``html`` with only the first `<script src=src>`: the renderer repeats both with every figure,
    and a second MathJax raises in the page. Each figure's drawing script comes after the first
    (plain scripts run in document order), so every figure finds plotly and MathJax defined."""
    tag = re.compile(rf"""<script[^>]*\ssrc="{re.escape(src)}"[^>]*>\s*</script>""")
    first = tag.search(html)
    return html if first is None else html[:first.end()] + tag.sub("", html[first.end():])


def external_loads(html: str) -> list[str]:
    """Every script, stylesheet or module import ``html`` still loads from another host."""
    return [m.group(0)[:160] for pattern in EXTERNAL for m in pattern.finditer(html)]


def on_post_build(config, **kwargs) -> None:
    site = Path(config["site_dir"])
    (site / OFFLINE).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_js(), site / OFFLINE / "plotly.min.js")
    shutil.copyfile(MATHJAX, site / OFFLINE / "tex-svg.js")
    problems = []
    for path in sorted(site.rglob("*.html")):
        text = path.read_text(encoding="utf-8")
        new = make_offline(text, os.path.relpath(site, path.parent).replace(os.sep, "/") + "/")
        if new != text:
            path.write_text(new, encoding="utf-8")
        problems += [f"{path.relative_to(site)}: {load}" for load in external_loads(new)]
    if problems:
        raise PluginError("pages load from the internet, so draw nothing offline (scripts/docs_offline.py):\n  "
                          + "\n  ".join(problems))
