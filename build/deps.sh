#!/usr/bin/env bash
# Installs the Debian packages the tests need when they are missing:
# a C compiler (cgo, the C ABI test), redis-server and redis-cli (the Redis
# L2 tests, a cluster test included) and the shared libraries the Mooncake
# wheel's store client links (libibverbs, libnuma, libcurl).
#
# It says what it installs before installing it, and it never leaves a
# service running or enabled at boot: Debian's redis-server package would
# start redis and enable it (systemd unit and SysV links) from its postinst;
# the tests run their own redis-server processes. During the install a
# policy-rc.d refuses every start (unless the machine has its own policy,
# which is left alone); afterwards each service the installed packages ship
# is stopped if running and disabled.
set -euo pipefail
need=()
command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  ldconfig -p | grep -q "${lib%%:*}" || need+=("${lib##*:}")
done
[ ${#need[@]} -gt 0 ] || exit 0

echo "installing Debian packages: ${need[*]} (apt-get update first; services they ship are not started or enabled)" >&2
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  # invoke-rc.d and deb-systemd-invoke ask policy-rc.d; 101 = "action forbidden".
  printf '#!/bin/sh\n# build/deps.sh (kvshim): no service starts during its apt-get install\nexit 101\n' |
    $SUDO tee "$policy" >/dev/null
  $SUDO chmod 755 "$policy"
  trap '$SUDO rm -f "$policy"' EXIT
fi
$SUDO apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >&2

# Undo what the packages' postinsts did: enabled at boot (systemd wants
# symlinks, SysV rc links), and possibly started where a machine's own
# policy-rc.d allowed it.
for pkg in "${need[@]}"; do
  for path in $(dpkg-query -L "$pkg" 2>/dev/null | grep -E '^(/usr)?/lib/systemd/system/[^/@]+\.(service|socket|timer)$' || true); do
    unit=$(basename "$path")
    if [ -d /run/systemd/system ]; then
      $SUDO systemctl stop "$unit" >/dev/null 2>&1 || true
    fi
    # deb-systemd-helper records the choice, so an upgrade does not enable it again.
    $SUDO deb-systemd-helper disable "$unit" >/dev/null 2>&1 || $SUDO systemctl disable "$unit" >/dev/null 2>&1 || true
    echo "disabled $unit (installed by $pkg; the tests start their own)" >&2
  done
  for path in $(dpkg-query -L "$pkg" 2>/dev/null | grep -E '^/etc/init\.d/[^/]+$' || true); do
    script=$(basename "$path")
    [ -d /run/systemd/system ] || $SUDO invoke-rc.d "$script" stop >/dev/null 2>&1 || true
    $SUDO update-rc.d "$script" disable >/dev/null 2>&1 || true
  done
done
