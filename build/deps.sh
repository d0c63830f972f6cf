#!/usr/bin/env bash
# Installs the Debian packages the tests need when they are missing:
# a C compiler (cgo, the C ABI test), redis-server and redis-cli (the Redis
# L2 tests, a cluster test included) and the shared libraries the Mooncake
# wheel's store client links (libibverbs, libnuma, libcurl).
set -euo pipefail
need=()
command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  ldconfig -p | grep -q "${lib%%:*}" || need+=("${lib##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}" >&2
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >&2
  # Debian starts the packaged server; the tests run their own.
  (command -v systemctl >/dev/null && $SUDO systemctl stop redis-server) >/dev/null 2>&1 || true
fi
