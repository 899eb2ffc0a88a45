#!/usr/bin/env bash
# The test ids pytest collects at a git commit and in the working tree, and the difference: what a change to the
# suite removed or added (`pytest --full-matrix` is collected, so every cell of the matrices is listed).
#   bash scripts/test_ids.sh [REF]     REF: a commit, default HEAD~1
# Run it from the repository's root with the project's venv on PATH or as .venv (make test creates it).
set -euo pipefail
ref="${1:-HEAD~1}"
py="$(realpath "$(command -v "${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}")")"
tmp="$(mktemp -d)"
trap 'git worktree remove --force "$tmp/old" 2>/dev/null || true; rm -rf "$tmp"' EXIT
collect() {  # folder -> sorted ids on stdout
    (cd "$1" && PYTHONPATH="$PWD" "$py" -m pytest --collect-only -q --full-matrix -p no:cacheprovider tests 2>/dev/null \
        | grep '::' | sort)
}
git worktree add --quiet --detach "$tmp/old" "$ref"
collect "$tmp/old" > "$tmp/old.txt"
collect . > "$tmp/new.txt"
echo "$ref: $(wc -l < "$tmp/old.txt") tests; working tree: $(wc -l < "$tmp/new.txt") tests"
echo "-- gone:"
comm -23 "$tmp/old.txt" "$tmp/new.txt"
echo "-- new:"
comm -13 "$tmp/old.txt" "$tmp/new.txt"
