#!/usr/bin/env bash
# One entry point that does its own setup: a virtual environment in .venv, built from
# requirements.txt the first time (and again whenever requirements.txt changes).
#   ./workbench.sh app [streamlit args]   run the app on the shipped default checkpoint (preloaded: ui/serve.py)
#   ./workbench.sh test [pytest args]     run the test suite
#   ./workbench.sh lint                   ruff over the whole tree (CI runs it before the tests)
#   ./workbench.sh [python -m workbench args]   the command line (train, eval, ...)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${WORKBENCH_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
want="$(sha256sum requirements.txt | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.requirements.sha" 2>/dev/null)" != "$want" ]; then
  echo "setting up $VENV from requirements.txt (first run only; a few minutes)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -r requirements.txt >&2
  echo "$want" > "$VENV/.requirements.sha"
fi
cmd="${1:-help}"
[ $# -gt 0 ] && shift
case "$cmd" in
  app)  exec "$VENV/bin/python" -m ui.serve "$@" ;;  # streamlit run app.py, imports and default model preloaded
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
  lint) exec "$VENV/bin/ruff" check "$@" . ;;
  *)    exec "$VENV/bin/python" -m workbench "$cmd" "$@" ;;
esac
