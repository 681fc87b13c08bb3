#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what one run on a lent GPU machine needs, which has Python
# 3.12 with torch and torchaudio but reaches no package index or model hub:
#   .whl/   the wheels the minicpmo engine needs beyond torch (cp312, manylinux x86_64)
#   .gpu/   the public MiniCPM-o model code (--code-dir, never committed), the SDK wheel
#           (--sdk: the checkpoint's tokenizer), the default voice clip (espeak-ng, here)
# Both are git-ignored (.git/info/exclude); carry them with the generated stubs:
#   device run: carry [".whl", ".gpu", "proto/omni"], command "bash tools/gpu/run.sh"
# Usage: bash tools/gpu/bundle.sh --code-dir DIR --sdk WHEEL   (idempotent)
set -euo pipefail
cd "$(dirname "$0")/../.."
CODE= SDK=
while [ $# -gt 0 ]; do
  case "$1" in
    --code-dir) CODE=$2; shift 2 ;;
    --sdk) SDK=$2; shift 2 ;;
    *) echo "bundle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -d "$CODE" ] && [ -f "$CODE/modeling_minicpmo.py" ] \
  || { echo "bundle.sh: --code-dir must be the public MiniCPM-o code (modeling_minicpmo.py)" >&2; exit 2; }
[ -f "$SDK" ] || { echo "bundle.sh: --sdk must be the minicpm-o SDK wheel" >&2; exit 2; }
PY=${OMNI_VENV:-$PWD/.venv}/bin/python
# The minicpmo extra's pins as the GPU host takes them (its torch stays; transformers is the
# vocoder package's bound, <4.53), plus the fabric's own packages.
WHEELS=(
  transformers==4.51.3 tokenizers==0.21.4 huggingface_hub==0.36.2
  hyperpyyaml==1.2.3 ruamel.yaml==0.18.17 ruamel.yaml.clib==0.2.15 librosa==0.11.0
  soundfile==0.14.0 soxr==1.1.0 audioread==3.1.0 pooch==1.9.0 platformdirs==4.14.8
  decorator==5.3.1 cffi==2.1.1 pycparser==3.12 grpcio==1.85.1 protobuf==7.36.2
  websockets==17.4 orjson==3.13.0 pybase64==1.5.1 grpcio-health-checking==1.85.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
)
# Requirements the device run never imports, and why. tests/tools/test_gpu_scripts.py checks
# that every requirement is carried, on the host (tools/gpu/host_packages.txt) or here, and
# rehearses the run's imports with only those packages.
NOT_NEEDED=(
  "grpcio-tools: the stubs travel generated (proto/omni)"
  "av: the edge's WAV/video reader; gpu_sessions reads .gpu/fixture.npy (the wheel is 36 MB)"
  "opentelemetry-exporter-otlp-proto-grpc: imported only where an OTLP endpoint is set"
  "silero-vad: half-duplex turns only"
  "diffusers: not on the vocoder path the engine runs"
)
mkdir -p .whl .gpu/code .gpu/sdk .gpu/cache
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" \
  2>&1 | grep -v 'is ignored' || true
# The vocoder package is an sdist only (pure Python): built into a wheel here.
ls .whl/minicpmo_utils-1.0.7-*.whl >/dev/null 2>&1 \
  || "$PY" -m pip wheel -q --no-deps -w .whl minicpmo-utils==1.0.7 2>&1 | grep -v 'is ignored' || true
for w in "${WHEELS[@]}" minicpmo-utils==1.0.7; do
  name=$(echo "${w%%==*}" | tr '.-' '__'); version=${w##*==}
  ls .whl | grep -qi "^${name}-${version}-" || { echo "bundle.sh: $w missing from .whl" >&2; exit 1; }
done
rm -rf .gpu/code/MiniCPMO45 && cp -r "$CODE" .gpu/code/MiniCPMO45
rm -f .gpu/sdk/*.whl && cp "$SDK" .gpu/sdk/
OMNI_CACHE_DIR=$PWD/.gpu/cache "$PY" -c \
  "from omnifabric.common.paths import cache_root; from omnifabric.worker.engines.minicpmo.voice import project_clip; print(project_clip(cache_root()))"
# gpu_sessions' fixture as samples: the WAV reader needs the av wheel (36 MB, past what a
# device call carries beside the rest).
"$PY" -c "import numpy as np; from pathlib import Path; from omnifabric.tools.probe import read_wav_16k; np.save('.gpu/fixture.npy', read_wav_16k(Path('tests/fixtures/speech/question.wav')))"
"$PY" tools/gen_stubs.py
# The run's imports rehearsed with only the host's packages and these wheels (~15 s).
"$PY" -m pytest -q -p no:randomly -p no:cacheprovider tests/tools/test_gpu_scripts.py \
  -k "requirement or imports_only" >/dev/null \
  || { echo "bundle.sh: the device run would miss a package: pytest tests/tools/test_gpu_scripts.py" >&2; exit 1; }
for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude; done
echo "bundle ready: $(ls .whl | wc -l) wheels ($(du -sh .whl | cut -f1)), .gpu $(du -sh .gpu | cut -f1)"
