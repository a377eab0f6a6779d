#!/usr/bin/env bash
# Installs sluice's build and test dependencies (Debian packages, PyPI
# packages). Safe to run again. Needs root (or sudo) for apt-get.
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
pkgs="build-essential pkg-config libjsmn-dev libpcre2-dev libevent-dev libsqlite3-dev libopenblas-dev unzip curl python3 python3-pip gnuplot-nox"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
command -v pip3 >/dev/null 2>&1 || command -v pip >/dev/null 2>&1 || python3 -m pip --version >/dev/null
# the official OpenAI client drives the server in tests/test_server.py
python3 -c 'import openai' 2>/dev/null || python3 -m pip install -q --disable-pip-version-check openai
