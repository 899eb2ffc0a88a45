#!/usr/bin/env bash
# The test ids pytest collects at a git commit and in the working tree, and the difference: what a change to the
# suite removed or added, for CI's tier and for the whole matrix (`--full-matrix`).
#   bash scripts/test_ids.sh [REF]     REF: a commit, default HEAD~1
# Run it from the repository's root with the project's venv as .venv (make test creates it) or PYTHON set.
set -euo pipefail
ref="${1:-HEAD~1}"
py="$(command -v "${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}")"
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute, the venv's own (not its symlink's target)
tmp="$(mktemp -d)"
trap 'git worktree remove --force "$tmp/old" 2>/dev/null || true; rm -rf "$tmp"' EXIT
collect() {  # folder, pytest options -> sorted ids on stdout (the folder's own hfsdp first on sys.path)
    local folder="$1"
    shift
    (cd "$folder" && PYTHONPATH="$PWD" "$py" -m pytest --collect-only -q -p no:cacheprovider "$@" tests 2>/dev/null \
        | grep '::' | sort) || true
}
git worktree add --quiet --detach "$tmp/old" "$ref"
for tier in ci full; do
    options=()
    [ "$tier" = full ] && options=(--full-matrix)
    collect "$tmp/old" "${options[@]}" > "$tmp/old.txt"
    collect . "${options[@]}" > "$tmp/new.txt"
    echo "== $tier: $ref $(wc -l < "$tmp/old.txt") tests, working tree $(wc -l < "$tmp/new.txt") tests"
    echo "-- gone:"
    comm -23 "$tmp/old.txt" "$tmp/new.txt"
    echo "-- new:"
    comm -13 "$tmp/old.txt" "$tmp/new.txt"
done
