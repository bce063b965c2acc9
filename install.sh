#!/usr/bin/env bash
# Install fp4jax into ./.venv with the pinned versions of constraints.txt.
#   ./install.sh            (re-running is cheap: it reinstalls only when setup.py or the pins change)
# Needs Python >= 3.12 (jax 0.11 requires it): looked for on PATH, then among pyenv's versions.
set -euo pipefail
cd "$(dirname "$0")"

version_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in "${FP4JAX_PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && version_ok "$(command -v "$c")" && { command -v "$c"; return; }
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
  roots+=("$HOME/.pyenv" "/root/.pyenv")
  for r in "${roots[@]}"; do
    for c in $(ls -d "$r"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -rV); do
      version_ok "$c" && { echo "$c"; return; }
    done
  done
  return 1
}

stamp=$(cat setup.py constraints.txt | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat .venv/.fp4jax-stamp 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
if ! py=$(find_python); then
  echo "install.sh: fp4jax needs Python >= 3.12 (jax 0.11 requires it); none found on PATH or in pyenv." >&2
  echo "install.sh: install one (e.g. 'pyenv install 3.12') or set FP4JAX_PYTHON=/path/to/python3.12." >&2
  exit 1
fi
echo "install.sh: using $py ($("$py" --version))"
[ -x .venv/bin/python ] && version_ok .venv/bin/python || "$py" -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
echo "$stamp" > .venv/.fp4jax-stamp
echo "install.sh: installed into .venv"
