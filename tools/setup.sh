#!/usr/bin/env bash
# Installs what sluice needs to build, test and run: the Debian packages, the
# official `openai` Python client (tests/test_*.py drive the server with it)
# and Selenium (tests/test_webui.py drives Debian's chromium with it).
# Installs only what is missing, so it is safe to run again; make runs it by
# itself when a dependency is absent (the Makefile's "Dependencies" block).
# Needs root or sudo for apt-get.
#   tools/setup.sh             install what is missing
#   tools/setup.sh --dry-run   print what it would install, install nothing
set -euo pipefail
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
run() {
    if [ "$dry" -eq 1 ]; then echo "would run: $*"; else "$@"; fi
}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
# build-essential: gcc and make; libjsmn-dev, libpcre2-dev, libevent-dev,
# libsqlite3-dev: the libraries sluice links; curl, unzip, python3, python3-pip:
# the model fetch (tools/fetch_model.sh) and the integration tests; xz-utils:
# the tests' vocab files (tests/data/vocab/*.gguf.xz); gnuplot-nox:
# `sluice bench --plot`; chromium, chromium-driver: the web page's browser test
# (headless, through the driver; no browser is ever downloaded).
pkgs="build-essential pkg-config libjsmn-dev libpcre2-dev libevent-dev libsqlite3-dev unzip xz-utils curl python3 python3-pip gnuplot-nox chromium chromium-driver"
missing=""
if command -v dpkg >/dev/null 2>&1; then
    for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
else
    echo "setup: not a Debian system; install the equivalents of: $pkgs" >&2
fi
if [ -n "$missing" ]; then
    echo "setup: installing$missing" >&2
    run $SUDO apt-get update -qq
    run env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
# Debian's own python3 refuses pip installs outside a virtual environment
# (PEP 668) and packages no openai client (and its python3-selenium serves
# only Debian's python3); the tests need them importable by the python3 on
# PATH, so install them there.
pymissing=""
python3 -c 'import openai' 2>/dev/null || pymissing="$pymissing openai"
python3 -c 'import selenium' 2>/dev/null || pymissing="$pymissing selenium"
if [ -n "$pymissing" ]; then
    echo "setup: installing the Python packages$pymissing" >&2
    pip=(python3 -m pip install -q --disable-pip-version-check $pymissing)
    if python3 -c 'import sys, sysconfig, os; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")))'; then
        pip+=(--break-system-packages)
    fi
    run "${pip[@]}"
fi
