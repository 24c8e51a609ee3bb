#!/usr/bin/env bash
# The Debian packages that the real-cluster tests run: Slurm (slurm-wlm, with munge for its
# authentication) and Open MPI (openmpi-bin, libopenmpi-dev); and Chromium, in which
# tests/docs opens the built documentation site. `make test` calls this first.
#
#   scripts/cluster_packages.sh install   install what is missing (root and apt-get only), else
#                                         say why not; exits 0 either way, the tests then skip
#                                         naming the reason
#   scripts/cluster_packages.sh missing   print the missing packages, one a line
set -euo pipefail

PACKAGES=(slurm-wlm munge openmpi-bin libopenmpi-dev chromium)

say() { printf '%s\n' "cluster_packages: $*" >&2; }

missing() {
    local package
    for package in "${PACKAGES[@]}"; do
        if [[ $(dpkg-query -W -f='${Status}' "$package" 2>/dev/null) != "install ok installed" ]]; then
            echo "$package"
        fi
    done
}

install() {
    if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
        say "not a Debian system (no apt-get): the Slurm, Open MPI and browser tests will skip"
        return
    fi
    local wanted
    mapfile -t wanted < <(missing)
    if ((${#wanted[@]} == 0)); then return; fi
    if [[ $(id -u) != 0 ]]; then
        say "not root, cannot install ${wanted[*]}: the tests that need them will skip"
        return
    fi
    say "installing ${wanted[*]}"
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
    # A fresh machine may have no package lists yet, or stale ones.
    if ! "${apt[@]}" "${wanted[@]}" >/dev/null; then
        apt-get update -q >/dev/null
        "${apt[@]}" "${wanted[@]}" >/dev/null
    fi
}

case "${1:-}" in
    install) install ;;
    missing) missing ;;
    *) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
