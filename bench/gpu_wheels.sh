#!/usr/bin/env bash
# The wheels bench/gpu_step.py needs on the device machine beyond its image's packages (CPython
# 3.12 with torch and transformers; no package registry): kuberl itself, and pydantic and boto3
# (what kuberl's trainer imports that the image lacks) with their dependencies, at the versions
# installed here. They land in .whl (.gitignore leaves it out), which the device run carries:
#   bash bench/gpu_wheels.sh
#   run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps --no-compile
#       --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
#       python3 bench/gpu_step.py | tee $OUT/gpu_step.log")
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
rm -rf "$out"
mkdir -p "$out"
had_build=0
[ -d build ] && had_build=1
python3 -m pip wheel -q --no-deps -w "$out" .
[ "$had_build" = 1 ] || rm -rf build  # setuptools' staging copy of the package
pins=$(python3 - <<'PY'
from importlib.metadata import version
names = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection",
         "boto3", "botocore", "jmespath", "s3transfer"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
# shellcheck disable=SC2086  # one argument per pin
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$out" $pins
du -sh "$out"
ls "$out"
