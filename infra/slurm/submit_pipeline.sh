#!/bin/bash
# Submit the whole Atlas pipeline to SLURM as one chain of jobs (run it on a login node, in the
# environment where `atlas` is installed; the config, the run directory and the repository must be
# on a file system that the compute nodes share):
#
#   infra/slurm/submit_pipeline.sh /shared/atlas/configs/corpus-v1.yaml
#
# It plans chunk and tag here (that fixes N, the number of shards of every map stage), then submits,
# each job starting only when the one before it succeeded:
#
#   chunk array (T tasks) => tag array (T, GPU) -> [chunk,tag,vocab] -> [cluster] -> [coherence]
#   -> [label] -> [library] -> [targets] -> [train_annotator; plan annotate,tokenize]
#   -> annotate array (T, GPU) => tokenize array (T) -> [annotate,tokenize,index]
#
# "=>" is --dependency=aftercorr: tag task i starts as soon as chunk task i succeeded (shard i of a map stage
# reads only shard i of the one before), not when the whole chunk array is done; "->" is afterok on the
# whole job. T = min(N, MaxArraySize): SLURM refuses arrays past MaxArraySize (1001 tasks by default), so with
# more shards task i runs shards i, i+T, i+2T, ... (the same shards in every map stage, which keeps aftercorr
# correct).
#
# Array tasks run one shard each through `atlas stage NAME --run-dir RUN --shard $SLURM_ARRAY_TASK_ID`;
# the [bracketed] jobs run `atlas run CONFIG --stages ... --inline` (infra/slurm/stages.sbatch), which
# finalizes the map stages whose arrays are done and runs the global stages. If a job fails, the jobs
# after it are cancelled (--kill-on-invalid-dep); fix the cause and run this script again: finished
# shards and stages are skipped.
#
# Environment:
#   MAX_PARALLEL=200        array tasks at once (CPU arrays); GPU_PARALLEL=64 for tag and annotate
#   SBATCH_ARGS="..."       extra sbatch options for every job, e.g. "--partition=batch --account=lm"
#   GPU_STAGES="coherence label library targets train_annotator"   global stages whose job also gets
#                           --gres=gpu:1 (default: none; with llm.engine vllm, list every LLM step)
#   MAX_ARRAY_SIZE=1001     SLURM's MaxArraySize (default: read with `scontrol show config`, else 1001)
#   DRY_RUN=1               print the sbatch commands instead of submitting (the plan still runs)
set -euo pipefail

CONFIG="$(realpath "${1:?usage: submit_pipeline.sh CONFIG}")"
HERE="$(cd "$(dirname "$0")" && pwd)"
MAX_PARALLEL="${MAX_PARALLEL:-200}"
GPU_PARALLEL="${GPU_PARALLEL:-64}"
GPU_STAGES="${GPU_STAGES:-}"
read -r -a EXTRA <<< "${SBATCH_ARGS:-}"
ATLAS_PYTHON="$(dirname "$(command -v atlas)")/python"   # the interpreter atlas is installed in
mkdir -p logs                                           # the templates write logs/atlas-*.out

# Plan the first two map stages (tag has one shard per chunk shard), then read N and the run directory.
atlas plan "$CONFIG" --stages chunk,tag
INFO="$("$ATLAS_PYTHON" - "$CONFIG" <<'PY'
import sys
from atlas.config import load_config
from atlas.core.rundir import RunDir

run = RunDir(load_config(sys.argv[1]).run_dir)
print(run.read_manifest()["stages"]["chunk"]["num_shards"], run.root)
PY
)"
read -r N RUN_DIR <<< "$INFO"
if [ -z "${MAX_ARRAY_SIZE:-}" ]; then
  MAX_ARRAY_SIZE="$(scontrol show config 2>/dev/null | awk '$1 == "MaxArraySize" {print $3}')"
fi
MAX_ARRAY_SIZE="${MAX_ARRAY_SIZE:-1001}"
TASKS=$(( N < MAX_ARRAY_SIZE ? N : MAX_ARRAY_SIZE ))  # array indices 0..TASKS-1 stay below MaxArraySize
STRIDE=()                                             # the templates' second argument: shards per task > 1
[ "$TASKS" -lt "$N" ] && STRIDE=("$TASKS")
echo "run directory $RUN_DIR: $N shard(s) per map stage, arrays of $TASKS task(s)"

LAST=""      # the job the next one waits for
AFTER=afterok  # how: afterok (the whole job) or aftercorr (task i after task i of an array of the same size)
submit() {  # submit NAME SBATCH-ARGS... : sbatch after $LAST ($AFTER); sets LAST to the new job id
  local name="$1"; shift
  local cmd=(sbatch --parsable --kill-on-invalid-dep=yes ${EXTRA[@]+"${EXTRA[@]}"})
  [ -n "$LAST" ] && cmd+=(--dependency="$AFTER:$LAST")
  cmd+=("$@")
  if [ -n "${DRY_RUN:-}" ]; then
    echo "${cmd[*]}"
    LAST="dry-${name//,/-}"
  else
    LAST="$("${cmd[@]}" | cut -d';' -f1)"
    echo "$name: job $LAST"
  fi
}
array() {  # array STAGE PARALLEL [aftercorr]: TASKS tasks over the N shards
  AFTER="${3:-afterok}"
  submit "$1" --array="0-$((TASKS - 1))%$2" "$HERE/$1_array.sbatch" "$RUN_DIR" ${STRIDE[@]+"${STRIDE[@]}"}
  AFTER=afterok
}
stages() {  # stages STAGES [PLAN_NEXT]: one job, in order
  local gres=()
  for s in ${1//,/ }; do [[ " $GPU_STAGES " == *" $s "* ]] && gres=(--gres=gpu:1); done
  submit "$1" --job-name="atlas-${1//,/-}" ${gres[@]+"${gres[@]}"} "$HERE/stages.sbatch" "$CONFIG" "$@"
}

array chunk "$MAX_PARALLEL"
array tag "$GPU_PARALLEL" aftercorr
stages chunk,tag,vocab
for stage in cluster coherence label library targets; do
  stages "$stage"
done
stages train_annotator annotate,tokenize      # annotate is planned from the annotator's config
array annotate "$GPU_PARALLEL"
array tokenize "$MAX_PARALLEL" aftercorr
stages annotate,tokenize,index
echo "${DRY_RUN:+(dry run) }submitted; follow with: squeue --me   and   atlas status $RUN_DIR"
