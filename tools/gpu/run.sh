#!/bin/bash
# One prepared run on a lent GPU machine (tools/gpu/bundle.sh made .whl and .gpu here first):
# install offline, the opt-in equality tests on CUDA (speech, vocoder, static decode, mel),
# the full-size random-weight checkpoint with its vocoder (~40 s), then gpu_sessions' figures
# with nvidia-smi sampled each second. Output under $OUT (the device tool brings it back).
#   STAGE=all or a comma list of tests,vocoder,figures (one device call runs at most 600 s:
#   tests,vocoder in one, figures in the next)  TEST_S / VOC_S / FIG_S: time limits  TEST_K: pytest -k
#   VOC_COUNTS=1,8,32,64: vocoder_bench's sessions (ragged vs static/graphs, released sizes)
#   VOC_STEPS=5 (the unified layout's flow steps)  VOC_TF32=both (full float32, then TF32)
#   COUNTS=1,16,32,64  UNITS=8  WARMUP=1 (untimed units first in each run)  MODES=batched,batched-eager,serial-vocoder  EXTRA="--profile /tmp/prof"
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
t0=$(date +%s)
source tools/gpu/install.sh || exit 1
export OMNI_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, torchaudio; print(torch.__version__, torchaudio.__version__)" | tee -a $OUT/gpu.txt
STAGE=${STAGE:-all}
want() { [[ ",$STAGE," == *",all,"* || ",$STAGE," == *",$1,"* ]]; }
if want tests; then
  OMNI_MINICPMO_CODE_DIR=$PWD/.gpu/code/MiniCPMO45 OMNI_MINICPMO_SDK=$(ls $PWD/.gpu/sdk/*.whl) \
  OMNI_MINICPMO_DEVICE=cuda OMNI_MINICPMO_DTYPE=float32 \
  timeout ${TEST_S:-200} python3 -m pytest -x -p no:cacheprovider tests/worker/minicpmo/test_vocoder_batch.py \
     tests/worker/minicpmo/test_batched_step.py tests/worker/minicpmo/test_mel.py \
     tests/worker/minicpmo/test_audio_batch.py -k "${TEST_K:-speech or vocoder or greedy_equals_solo or static or mel or unseeded or decode_ahead or tts_ahead or graphs_captured or steady_buckets or rows_match or either_path}" -v 2>&1 | tee $OUT/tests.txt | grep -v PASSED | tail -25
  echo "tests done at $(( $(date +%s) - t0 )) s"
fi
if want vocoder; then
  timeout ${VOC_S:-180} python3 -m omnifabric.tools.vocoder_bench --device cuda --full \
     --counts ${VOC_COUNTS:-1,8,32,64} --timesteps ${VOC_STEPS:-5} --tf32 ${VOC_TF32:-both} --deviation 2 --json $OUT/vocoder.json 2>&1 | grep -v Warning | tee $OUT/vocoder.txt | tail -18
  echo "vocoder done at $(( $(date +%s) - t0 )) s"
fi
if want figures; then
  # a warm machine keeps /tmp between calls: the checkpoint is built once
  [ -f /tmp/ck/assets/token2wav/hift.pt ] || python3 -m omnifabric.tools.minicpmo_tiny --code-dir .gpu/code/MiniCPMO45 --sdk $(ls .gpu/sdk/*.whl) \
     --out /tmp/ck --full --device cuda 2>&1 | tail -3 | tee $OUT/build.txt
  echo "built at $(( $(date +%s) - t0 )) s"
  (while true; do nvidia-smi --query-gpu=utilization.gpu,utilization.memory,power.draw,memory.used --format=csv,noheader; sleep 1; done) > $OUT/smi.txt 2>&1 &
  SMI=$!
  timeout ${FIG_S:-330} python3 -m omnifabric.tools.gpu_sessions --engine minicpmo --model-dir /tmp/ck --device cuda:0 --fixture .gpu/fixture.npy \
     --batched ${COUNTS:-1,8,32,64} --modes ${MODES:-batched,serial-vocoder} --units ${UNITS:-8} \
     --warmup-units ${WARMUP:-1} ${EXTRA:-} --json $OUT/figures.json 2>&1 | grep -v Warning | tee $OUT/figures.txt | tail -60
  kill $SMI
  echo "figures done at $(( $(date +%s) - t0 )) s"
fi
