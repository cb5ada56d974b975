#!/usr/bin/env bash
# Install a Slurm scheduler and shellcheck for tests/test_slurm.py (Debian/Ubuntu, run as root).
#
#     bash .ci/install_slurm.sh
#
# Idempotent: does nothing when everything is already there. Never fails the CI: when it cannot install
# (not root, no apt-get, no network) it prints why and exits 0, and tests/test_slurm.py then skips with
# a reason. No daemon is started or enabled here; the tests start their own, loopback-only.
set -u

need=()
for pkg in munge slurmctld slurmd slurm-client shellcheck; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -eq 0 ]; then
    echo "install_slurm: munge, slurmctld, slurmd, slurm-client and shellcheck already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: no apt-get on this machine, not installing ${need[*]}; the Slurm tests will skip"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_slurm: not root, not installing ${need[*]}; the Slurm tests will skip"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Packages' maintainer scripts must not start daemons on a CI machine (no init there anyway).
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && trap 'rm -f "$policy"' EXIT
fi
ok=0
if apt-get update -qq >/tmp/install_slurm.log 2>&1 &&
   apt-get install -y -qq --no-install-recommends "${need[@]}" >>/tmp/install_slurm.log 2>&1; then
    ok=1
fi
if [ "$ok" -eq 1 ]; then
    echo "install_slurm: installed ${need[*]}"
else
    echo "install_slurm: apt-get could not install ${need[*]} (last lines of /tmp/install_slurm.log below);" \
         "the Slurm tests will skip"
    tail -n 5 /tmp/install_slurm.log
fi
exit 0
