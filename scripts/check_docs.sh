#!/usr/bin/env bash
# The documentation checks CI runs; installs nothing (CI installs the docs extra first:
# pip install --no-build-isolation -e ".[docs]").
#   1. the site builds with warnings as errors: a broken link or reference, or a documented name that was
#      renamed, fails it;
#   2. the results pages and the README's results table are what benchmarks/results/*.json give.
# The code blocks of the docs run in tests/test_docs.py, with the other tests.
set -euo pipefail
cd "$(dirname "$0")/.."

site_dir=$(mktemp -d)
trap 'rm -rf "$site_dir"' EXIT
echo "== mkdocs build --strict =="
python3 -m mkdocs build --strict --site-dir "$site_dir"
echo "== results pages against benchmarks/results =="
python3 benchmarks/results_pages.py --check
