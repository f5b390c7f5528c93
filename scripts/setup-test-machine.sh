#!/usr/bin/env bash
# What `python -m pytest tests` needs besides the Python packages of `pip install -e ".[test]"`:
#
#   - a C++ compiler: our CPU kernels are built at first use (torch.utils.cpp_extension);
#   - curl: tests/test_readme.py runs the README's quick start, whose request is a curl line;
#   - Debian's `chromium`: tests/test_dashboard.py drives it headless through Playwright
#     (Playwright's own browser download is not used).
#
# It says what it finds and what it does, installs only what is missing (with apt-get, as root or
# through sudo), and can be run any number of times.  It exits non-zero, saying why, when
# something is missing and cannot be installed.  TOKENLOOM_NO_BROWSER=1 leaves Chromium out (the
# browser test is then skipped, not failed).
set -euo pipefail

say() { echo "setup-test-machine: $*"; }
fail() { echo "setup-test-machine: ERROR: $*" >&2; exit 1; }

missing=()  # Debian packages to install

# ---- a C++ compiler for the CPU kernels
if command -v c++ >/dev/null || command -v g++ >/dev/null; then
  say "C++ compiler: $(command -v c++ || command -v g++) (builds tokenloom's CPU kernels at first use)"
else
  say "C++ compiler: none; tokenloom's CPU kernels are built at first use, so it needs g++"
  missing+=(g++)
fi

# ---- curl for the README's quick start
if command -v curl >/dev/null; then
  say "curl: $(command -v curl) (the README's quick start, run by tests/test_readme.py)"
else
  say "curl: none; tests/test_readme.py runs the README's quick start, which asks the server with curl"
  missing+=(curl)
fi

# ---- Chromium for the dashboard's browser test
chromium_path() {
  local name
  for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null; then command -v "$name"; return 0; fi
  done
  return 1
}
if [[ "${TOKENLOOM_NO_BROWSER:-}" == 1 ]]; then
  say "Chromium: not checked (TOKENLOOM_NO_BROWSER=1: tests/test_dashboard.py's browser test will be skipped)"
elif exe=$(chromium_path); then
  say "Chromium: $exe (drives tests/test_dashboard.py's browser test)"
else
  say "Chromium: none; tests/test_dashboard.py drives Debian's chromium headless, so it is needed"
  missing+=(chromium)
fi

if ((${#missing[@]} == 0)); then
  say "nothing to install"
  exit 0
fi

# ---- install what is missing
command -v apt-get >/dev/null ||
  fail "no apt-get on this machine: install ${missing[*]} with its package manager" \
       "(or set TOKENLOOM_NO_BROWSER=1 to skip the browser test)"
if [[ $(id -u) == 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  fail "installing ${missing[*]} needs root: run \`sudo apt-get install -y ${missing[*]}\`," \
       "or this script as root (or set TOKENLOOM_NO_BROWSER=1 to skip the browser test)"
fi
say "installing ${missing[*]} with apt-get (${as_root[*]:-as root}); this takes a minute or two"
"${as_root[@]}" apt-get update -qq || fail "apt-get update failed (no network or no package mirror?)"
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" \
  >/dev/null || fail "apt-get install ${missing[*]} failed"

# ---- check that what was installed works
for pkg in "${missing[@]}"; do
  case "$pkg" in
    chromium)
      exe=$(chromium_path) || fail "chromium was installed but is not on PATH"
      version=$("$exe" --headless --no-sandbox --version 2>/dev/null) || fail "$exe does not start"
      say "Chromium: installed $exe ($version)";;
    g++)
      say "C++ compiler: installed $(command -v g++)";;
    curl)
      say "curl: installed $(command -v curl)";;
  esac
done
