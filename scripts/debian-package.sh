#!/usr/bin/env bash
# Install a Debian package when its command is missing: the tools that are not
# on PyPI: wrk for `make bench-overhead` and `make test` (its harness's test),
# redis-server and PostgreSQL's server for `make test`. Needs root (or sudo)
# and Debian's package registry; prints what to run by hand when it cannot.
#
#   scripts/debian-package.sh COMMAND [PACKAGE]   # PACKAGE defaults to COMMAND
#
# COMMAND with a slash is a path pattern, for programs off the PATH:
# '/usr/lib/postgresql/*/bin/postgres' (package postgresql) is any version's server.
set -euo pipefail
cmd=$1
pkg=${2:-$1}
present() {
    if [[ $cmd == */* ]]; then
        compgen -G "$cmd" >/dev/null
    else
        command -v "$cmd" >/dev/null
    fi
}
present && exit 0

sudo=()
if [[ $(id -u) != 0 ]]; then
    if ! command -v sudo >/dev/null; then
        echo "error: '$cmd' is missing; install it as root: apt-get install $pkg" >&2
        exit 1
    fi
    sudo=(sudo)
fi
if ! command -v apt-get >/dev/null; then
    echo "error: '$cmd' is missing and this is not a Debian-like system; install the '$pkg' package" >&2
    exit 1
fi
echo "==> installing Debian's $pkg (for $cmd)"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "$pkg" >/dev/null
present
