#!/usr/bin/env bash
# The README's first command: run the demo on the embedded default.
#
#   build/demo.sh [kvshim demo flags]
#
# On the CPU it runs in a virtualenv with numpy (build/venv.sh). With
# --device cuda[:N] it runs under ${PYTHON:-python3} as it is: that
# interpreter needs torch with CUDA, and nothing is installed (a GPU machine
# may have no network). KVSHIM_LIBRARY overrides out/libkvshim.so.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cpu prev=""
for a in "$@"; do
	case "$a" in --device=*) device=${a#--device=} ;; esac
	[ "$prev" = --device ] && device=$a
	prev=$a
done
if [ "$device" = cpu ]; then
	py="$(build/venv.sh python/requirements-demo.txt)/bin/python"
else
	py=${PYTHON:-python3}
fi
export KVSHIM_LIBRARY="${KVSHIM_LIBRARY:-$PWD/out/libkvshim.so}" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m kvshim demo "$@"
