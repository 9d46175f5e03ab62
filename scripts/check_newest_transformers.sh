#!/usr/bin/env bash
# Is the newest transformers release pip serves within coat's supported range (coat/compat.py), and do the tests
# that need transformers (pytest marker `transformers`) pass against it? Installs it in a venv on top of the current
# environment (torch and coat's build shared, only transformers replaced), runs those tests and prints both answers.
# Exits with pytest's status: 0 when they pass. The procedure that follows: docs/design.md, "Moving the newest
# transformers end".
#
#   scripts/check_newest_transformers.sh [--skip-if-tested] [pytest arguments...]
#
# --skip-if-tested: stop before installing when the newest release is TRANSFORMERS_NEWEST, whose tests .ci/run's
# newest-end stage runs already. Further arguments go to pytest, e.g. -W error::FutureWarning to see the
# deprecations coat meets. PYTHON (default python3) is the environment to start from.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
skip_if_tested=false
if [[ ${1:-} == --skip-if-tested ]]; then
  skip_if_tested=true
  shift
fi

# What `pip install transformers` would install into an empty environment: the newest release for this Python.
newest=$("$python" -m pip install --quiet --dry-run --ignore-installed --no-deps --report - transformers |
  "$python" -c "import json, sys; print(json.load(sys.stdin)['install'][0]['metadata']['version'])")
read -r oldest tested position <<< "$("$python" -c "
import coat.compat as c
from packaging.version import Version
newest, tested = Version('$newest'), Version(c.TRANSFORMERS_NEWEST)
print(c.TRANSFORMERS_OLDEST, c.TRANSFORMERS_NEWEST, 'newer' if newest > tested else 'within')")"
echo "pip's newest transformers: $newest; coat supports $oldest to $tested (coat/compat.py)"
if [[ $position == within ]]; then
  echo "RANGE: $newest is within the supported range"
else
  echo "RANGE: $newest is NEWER than the supported range: coat.convert warns that it is untested"
fi
if [[ $skip_if_tested == true && $newest == "$tested" ]]; then
  echo "SKIPPED: $newest is the newest end, whose transformers tests the newest-end stage runs"
  exit 0
fi

venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet "transformers==$newest"
"$venv/bin/python" -c "import coat, transformers; print('testing coat', coat.__file__, 'with transformers', transformers.__version__)"
start=$SECONDS
status=0
"$venv/bin/python" -m pytest tests -m transformers -p no:cacheprovider "$@" || status=$?
if [[ $status == 0 ]]; then
  echo "TESTS: the transformers tests PASS with transformers $newest ($((SECONDS - start)) s)"
  next="move the newest end to $newest"
else
  echo "TESTS: the transformers tests FAIL with transformers $newest (pytest exit $status, $((SECONDS - start)) s)"
  next="fix coat for $newest, then move the newest end to it"
fi
if [[ $position == newer ]]; then
  echo "NEXT: $next (docs/design.md, \"Moving the newest transformers end\")"
fi
exit "$status"
