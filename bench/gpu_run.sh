#!/bin/bash
# Every GPU check and figure of the engine in one run on a lent CUDA machine (15 minutes of device
# time a session): from the project root, carrying .gpu (../shared/gpu's scripts and the model's
# config and tokenizer) and .whl (../shared/gpu/wheels.sh), as ../shared/gpu/README.md sets them up.
#   1. the Triton kernels' CUDA tests (they skip on the CPU) and bench.gpu_kernels
#   2. bench.gpu_check: greedy tokens alone = batched on CUDA for five strategies, graphs and eager
#   3. bench.gpu_step: a decode step at 4 and 16 sequences of 3.5k tokens beside the memory floor
#   4. bench.engine --synthetic: 20 x 3,500 x 256 at 4 full jobs' bytes, then HF's continuous batching
# Each stage has its own time limit; figures land in $OUT.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
[ -f /tmp/rmodel/config.json ] || python3 .gpu/mkmodel.py .gpu/model /tmp/rmodel || exit 1
export KVPLAN_MODEL=/tmp/rmodel KVPLAN_DEVICE=cuda KVPLAN_COMPUTE_DTYPE=bfloat16 KVPLAN_CACHE_DIR=/tmp/kvc
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
stage() { local t=$1; shift; echo "== $*"; timeout "$t" "$@" 2>&1 | grep -v Warning | tail -${TAIL:-25}; }
if [ -z "${SKIP_TESTS:-}" ]; then
  TAIL=12 stage ${TESTS_S:-60} python3 -m pytest --noconftest -p no:cacheprovider -q -rs tests/kernels/test_paged_decode.py \
    tests/kernels/test_decoder_ops_triton.py tests/kernels/test_paged_prefill.py -k "cuda"
fi
[ -n "${KERNEL_BENCH:-}" ] && stage 70 python3 -m bench.gpu_kernels --out "$OUT/kernels"
TAIL=14 stage ${CHECK_S:-60} python3 -m bench.gpu_check --length 400 --new-tokens 8 --out "$OUT/check"
TAIL=10 stage ${STEP_S:-60} python3 -m bench.gpu_step --steps 20 --out "$OUT/step"
stage ${ENGINE_S:-200} python3 -m bench.engine --synthetic --strategies ${STRATS:-full snapkv auto} \
  --budget-jobs ${JOBS:-4} --out "$OUT/engine"
[ -n "${PEER:-}" ] && stage ${PEER_S:-150} python3 .gpu/hf_peer.py --model /tmp/rmodel --budget-jobs ${JOBS:-4} \
  --out "$OUT/hf_peer.json"
exit 0
