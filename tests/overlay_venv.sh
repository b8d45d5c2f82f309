#!/usr/bin/env bash
# A venv that sees the project venv's packages (torch, transformers, eagle3_pipeline, ...) through a .pth
# file, with a few packages of its own installed on top (they win): a second torch install is never needed.
# Idempotent: a stamp names what was installed, and an unchanged list does nothing.
#
# usage: tests/overlay_venv.sh VENV_DIR MAIN_VENV_DIR CHECK_PYTHON_CODE PACKAGE==VERSION...
set -euo pipefail

venv="$1" main_venv="$2" check="$3"
shift 3
packages=("$@")
stamp="$venv/.eagle3-overlay-stamp"
want="$(printf '%s\n' "${packages[@]}" "main_venv=$main_venv")"

if [[ -f "$stamp" && "$(cat -- "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$main_venv/bin/python" ]]; then
  echo "overlay_venv.sh: $main_venv/bin/python not found; build the project venv first (make venv)" >&2
  exit 1
fi
base_python="$("$main_venv/bin/python" -c 'import sys; print(sys._base_executable)')"

rm -rf -- "$venv"
"$base_python" -m venv -- "$venv"
main_site="$("$main_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
own_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir appends after the venv's own site-packages (anything installed here wins) and
# also runs the main venv's .pth files, e.g. the editable install of eagle3_pipeline.
printf 'import site; site.addsitedir(%s)\n' "$("$main_venv/bin/python" -c 'import sys; print(repr(sys.argv[1]))' "$main_site")" \
  > "$own_site/zz_eagle3_main_venv.pth"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${packages[@]}"
"$venv/bin/python" -c "$check"
printf '%s\n' "$want" > "$stamp"
