#!/usr/bin/env bash
# Remake the wheels beside this file from requirements.txt (PyPI; run on a machine that reaches it).
# Every one is pure Python; multiprocess ships one wheel per Python version, so both the GPU
# machine's (3.12) and this project's (3.11) are kept, and pip picks the one that fits.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
reqs=$(sed -e 's/#.*//' -e '/^\s*$/d' "$here/requirements.txt")
for v in 3.12 3.11; do
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary :all: --python-version "$v" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$here" $reqs
done
ls -la "$here"
