#!/usr/bin/env bash
# The accelerator's checks as one script, for a machine with a GPU and JAX's CUDA build:
#
#     bash benchmarks/gpu_checks.sh [RESULTS_DIR]        # default benchmarks/results
#
# 1. benchmarks/sweep.py, the vmap path with skips (a lax.cond per skip, decided once for the
#    batch) and without (every branch masked, no conditional), grids of 1024, 16, 64 and 256
#    configurations (the largest first: its compaction compiles every batch shape the smaller
#    grids use), every run to the end; python loop timed on 8 runs per grid, simulate on 2
#    (one run at a time is the slow way on a GPU). Writes sweep_gpu.{md,json} and
#    sweep_gpu_scaling.png.
# 2. The 1024 grid again, both paths, with XLA's CUDA-graph command buffers for conditionals
#    and loops (--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE), so a step's lax.conds
#    are decided on the device instead of by a copy of each predicate to the host:
#    sweep_gpu_cmdbuf.*.
# Each part has a time limit, so the whole stays inside one call of a lent machine; the log
# of each goes beside its tables.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-benchmarks/results}
mkdir -p "$RESULTS/cmdbuf"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee "$RESULTS/sweep_gpu_env.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" \
    2>&1 | tee -a "$RESULTS/sweep_gpu_env.txt"

XLA_FLAGS="" timeout "${SWEEP_LIMIT:-400}" python3 benchmarks/sweep.py --sizes 1024,16,64,256 \
    --paths vmap-skip,vmap-noskip \
    --sample 8 --simulate-sample 2 --full-vmap-up-to 1024 --results "$RESULTS" 2>&1 \
    | grep -v "^sweep:" | tee "$RESULTS/sweep_gpu.log"
echo "sweep.py exit: ${PIPESTATUS[0]}"

XLA_FLAGS="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE" timeout "${CMDBUF_LIMIT:-150}" \
    python3 benchmarks/sweep.py --sizes 1024 --paths vmap-skip,vmap-noskip --sample 2 --simulate-sample 0 \
    --full-vmap-up-to 1024 --results "$RESULTS/cmdbuf" 2>&1 | tail -n 40 | tee "$RESULTS/sweep_gpu_cmdbuf.log"
echo "command-buffer run exit: ${PIPESTATUS[0]}"
for f in "$RESULTS"/cmdbuf/sweep_gpu.*; do
    [ -e "$f" ] && mv "$f" "$RESULTS/sweep_gpu_cmdbuf.${f##*.}"
done
rm -rf "$RESULTS/cmdbuf"
