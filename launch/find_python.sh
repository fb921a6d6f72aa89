#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, or explains what is missing.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for cand in "${LP_PYTHON:-}" python3.12 python3 python3.13; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then command -v "$cand"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V); do
    p="$(pyenv root)/versions/$v/bin/python3"
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
fi
echo "error: lp_jax needs Python >= 3.12 (current JAX does not support older ones)." >&2
echo "       None was found as python3.13, python3.12, python3 or through pyenv." >&2
echo "       Install one (e.g. 'pyenv install 3.12') or set LP_PYTHON=/path/to/python3.12." >&2
exit 1
