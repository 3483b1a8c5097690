#!/usr/bin/env bash
# The Humble lane's venv: .venv-humble, Python 3.10 (Humble's) with Ubuntu 22.04's versions of the
# Python packages a robot gets from apt (constraints/humble-jammy.txt: numpy 1.21.5, PyYAML 5.4.1,
# jsonschema 3.2.0, ...) and the Jazzy wheels for cp310, made by scripts/setup.sh like .venv
# (gemma_spec_msgs built for it, the cached llama-cpp-python wheel: py3-none, no rebuild).
# test/node/test_humble_floor.py runs the engine and node tests in it.
#
# Python 3.10: $GEMMA_SPEC_PYTHON310, else python3.10 on PATH, else pyenv's newest 3.10. Where
# there is none this prints why and makes nothing (the lane's test then skips, saying so).
# Idempotent (setup.sh's stamps): a second run takes seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GEMMA_SPEC_HUMBLE_VENV:-$ROOT/.venv-humble}"
log() { printf '[humble-lane] %s\n' "$*"; }

python310() {
  local candidate
  for candidate in "${GEMMA_SPEC_PYTHON310:-}" "$(command -v python3.10 || true)" \
                   $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10.*/bin/python3.10 2>/dev/null | sort -V -r); do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys, venv; assert sys.version_info[:2] == (3, 10)' 2> /dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}
if ! PY310="$(python310)"; then
  log "no Python 3.10 here (GEMMA_SPEC_PYTHON310, python3.10 on PATH, pyenv's versions/3.10.*): no $VENV"
  exit 0
fi
log "Python $("$PY310" -c 'import platform; print(platform.python_version())') at $PY310"
# what pip's isolated build environments install (PyYAML 5.4.1's sdist needs Cython < 3): pip >= 25.3
# no longer applies PIP_CONSTRAINT there but takes --build-constraint
BUILD_CONSTRAINTS="$ROOT/constraints/humble-jammy-build.txt"
VENV="$VENV" PYTHON="$PY310" GEMMA_SPEC_CONSTRAINTS="$ROOT/constraints/humble-jammy.txt" \
  GEMMA_SPEC_BUILD_CONSTRAINTS="$BUILD_CONSTRAINTS" bash "$ROOT/scripts/setup.sh"
# every pin installed as pinned, also where an earlier run installed another version of it
pins=($(grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' "$ROOT/constraints/humble-jammy.txt"))
PIP_CONSTRAINT="$ROOT/constraints/humble-jammy.txt" "$VENV/bin/python" -m pip --disable-pip-version-check -q \
  install --build-constraint "$BUILD_CONSTRAINTS" "${pins[@]}"
# the constraints held (a pin pip could not honour would have failed above; this names the result)
"$VENV/bin/python" -c '
import sys, numpy, yaml, jsonschema, jinja2
print("[humble-lane] python", sys.version.split()[0], "numpy", numpy.__version__, "PyYAML", yaml.__version__,
      "jsonschema", jsonschema.__version__, "Jinja2", jinja2.__version__)'
