#!/usr/bin/env bash
# Build one engine release for the engine tier, once: tests/engines/setup.sh sglang 0.5.23
#
#   .engines/<engine>-<version>/site    the engine's wheel (--no-deps) + the pure-Python modules
#                                        pinned in tests/engines/<engine>_engine/requirements-<version>.txt
#   .engines/vllm-<version>/tests       vLLM's attention test harness, from its sdist
#
# torch, numpy, pydantic and pytest come from .venv; tests run with PYTHONPATH pointing here.
# Never lets pip resolve dependencies (that would pull a multi-GB CUDA torch). A build is
# reused while this script and the requirements file are unchanged (.stamp holds their hash).
set -euo pipefail
engine=$1
version=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
py=${PYTHON:-.venv/bin/python}
req=tests/engines/${engine}_engine/requirements-$version.txt
dest=.engines/$engine-$version
[ -f "$req" ] || { echo "no pinned requirements for $engine $version ($req)" >&2; exit 2; }
stamp=$(cat "$0" "$req" | sha256sum | cut -c1-16)
if [ -f "$dest/.stamp" ] && [ "$(cat "$dest/.stamp")" = "$stamp" ]; then
  exit 0
fi
echo "building $dest"
rm -rf "$dest"
mkdir -p "$dest/site" .engines/downloads
case $engine in
  sglang)
    "$py" -m pip install -qq --no-deps --only-binary=:all: --target "$dest/site" \
      "sglang==$version" -r "$req"
    ;;
  vllm)
    # The wheel's Python files only: its compiled parts (.so, the vllm-rs binary) and the
    # C++/CUDA sources its GPU kernels JIT-compile cannot run here.
    "$py" -m pip download -qq --no-deps --only-binary=:all: -d .engines/downloads "vllm==$version"
    unzip -q .engines/downloads/vllm-"$version"-*.whl -d "$dest/site" \
      -x '*.so' 'vllm/vllm-rs' '*.h' '*.hpp' '*.cuh' '*.inl' '*.cu' '*.cpp'
    "$py" -m pip install -qq --no-deps --target "$dest/site" -r "$req"
    # vLLM's correctness harness lives in its sdist; pip cannot fetch a vLLM sdist without
    # building it, so take its URL and sha256 from the index's JSON simple API (PEP 691).
    sdist=.engines/downloads/vllm-$version.tar.gz
    if [ ! -f "$sdist" ]; then
      read -r url sha < <(curl -fsS -H 'Accept: application/vnd.pypi.simple.v1+json' \
        https://pypi.org/simple/vllm/ | "$py" -c '
import json, sys
f = [f for f in json.load(sys.stdin)["files"] if f["filename"] == sys.argv[1]][0]
print(f["url"], f["hashes"]["sha256"])' "vllm-$version.tar.gz")
      curl -fsSL -o "$sdist.part" "$url"
      echo "$sha  $sdist.part" | sha256sum -c --quiet
      mv "$sdist.part" "$sdist"
    fi
    tar xzf "$sdist" -C "$dest" --strip-components=1 \
      "vllm-$version/tests/__init__.py" "vllm-$version/tests/v1/__init__.py" \
      "vllm-$version/tests/v1/attention/utils.py" \
      "vllm-$version/tests/v1/attention/test_attention_backends.py"
    rm -f .engines/downloads/vllm-"$version"-*.whl
    ;;
  *)
    echo "unknown engine $engine (sglang or vllm)" >&2
    exit 2
    ;;
esac
echo "$stamp" > "$dest/.stamp"
echo "built $dest ($(du -sh "$dest" | cut -f1))"
