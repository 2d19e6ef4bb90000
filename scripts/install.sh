#!/usr/bin/env bash
# pip install into a virtual environment, skipped when that environment already holds the same request:
#   bash scripts/install.sh VENV CONSTRAINTS [pip install arguments...]
# VENV/.flax_ckpt_installed keeps one line per install made there: a hash of the constraints file,
# pyproject.toml and the Python version, then the sorted arguments. An install whose hash matches a
# line, and whose arguments are all on it, is skipped ("-e .[test]" is on "-e .[docs,test]": extras
# are compared one by one). Anything else runs pip, then adds its line. Sources need no reinstall (the
# package is installed editable). The scripts that make an environment (test.sh, test_min.sh,
# test_clu.sh, docs.sh) install through this.
set -euo pipefail
venv=$1 constraints=$2
shift 2
stamp="$venv/.flax_ckpt_installed"
key=$(cat "$constraints" pyproject.toml <("$venv/bin/python" -V) | sha256sum | cut -c1-16)
# One word per requirement: "-e ." with extras [a,b] becomes ". .[a] .[b]"; other words as they are.
words() {
  local arg
  for arg in "$@"; do
    case "$arg" in
      -e) ;;
      *\[*\]) local base=${arg%%\[*} extras=${arg#*\[}; extras=${extras%\]}
              echo "$base"; tr ',' '\n' <<< "$extras" | sed "s|^|$base[|; s|$|]|" ;;
      *) echo "$arg" ;;
    esac
  done | sort -u | tr '\n' ' '
}
want=$(words "$@")
if [ -f "$stamp" ]; then
  while read -r line_key line_words; do
    [ "$line_key" = "$key" ] || continue
    missing=0
    for w in $want; do
      [[ " $line_words " == *" $w "* ]] || { missing=1; break; }
    done
    if [ "$missing" -eq 0 ]; then
      echo "install: $venv already holds $* (constraints and pyproject.toml unchanged)"
      exit 0
    fi
  done < "$stamp"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" "$@"
echo "$key $want" >> "$stamp"
