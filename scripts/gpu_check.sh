#!/usr/bin/env bash
# The GPU path, checked on ONE GPU (an H200) in at most 8 minutes:
#   (a) the debug LLaMA (seq 512, global batch 8, 20 steps): manual/auto x eager/compiled on the GPU,
#       each step's loss against a CPU run of the same job (max relative difference <= 1e-3);
#   (b) a ~1.5B LLaMA 3 shape (dim 2048, 16 layers, 32/8 heads, 128256 vocab, seq 2048, bf16, SAC op),
#       manual compiled vs auto compiled, 30 steps: tok/s, MFU, peak memory next to the plan's predicted peak;
#   (c) a CUDA profiler trace of the last step of each (b) run (scripts/gpu_check_profile.py).
# Prints one table (scripts/gpu_check_report.py); exits non-zero when a run fails or losses differ.
#
#   bash scripts/gpu_check.sh                  # writes $OUT (default outputs/gpu_check)
#   BUDGET_S=420 LBS_1B=8 PROFILE_DEBUG=1 bash scripts/gpu_check.sh
#   ONLY="cpu_ref auto_eager auto_compiled 1b_auto_compiled" bash scripts/gpu_check.sh   # these variants alone
#
# $OUT at the end: report.txt; 1b_{manual,auto}_compiled.json.gz (Chrome/Perfetto traces); kernels.txt
# (each trace's top ops and kernels); logs.tar.gz (every <variant>.log, status.tsv, versions.txt, the
# run folders runs/<variant>/{losses,plan}.json). Packed because the device tool brings back at most
# 8 files (PACK=0 leaves them loose).
set -uo pipefail  # no -e: a failing variant is recorded and the others still run
cd "$(dirname "$0")/.."

OUT=${OUT:-outputs/gpu_check}
BUDGET_S=${BUDGET_S:-450}          # every run ends by then (timeouts), leaving time for the report
HARDWARE=${HARDWARE:-h200}         # MFU peak and the planner's cost model
STEPS=${STEPS:-20}                 # (a)
STEPS_1B=${STEPS_1B:-30}           # (b)
LBS_1B=${LBS_1B:-4}                # (b) 4 x 2048 tokens a step: the plan predicts ~47 GiB of 140
CPU_THREADS=${CPU_THREADS:-4}      # the CPU reference runs beside the GPU runs: leave cores to them
PACK=${PACK:-1}
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEADLINE=$((SECONDS + BUDGET_S))
RUNS="$OUT/runs"                   # --job.dump_folder: losses.json, plan.json per variant
# nothing stale is read: earlier logs, run folders, traces go
rm -rf "${RUNS:?}" "$OUT"/status.tsv "$OUT"/*.log "$OUT"/*.json.gz "$OUT"/*_kernels.txt "$OUT"/logs.tar.gz
mkdir -p "$OUT" "$RUNS"

# ---------------------------------------------------------------- what we run with
"$PY" - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}"
      f" x {torch.cuda.device_count()}")
for mod in ("triton", "torchdata", "pulp", "highspy"):
    try:
        m = __import__(mod)
        print(f"{mod} {getattr(m, '__version__', '?')}")
    except ImportError:
        print(f"{mod} MISSING")
PY
if ! "$PY" -c "import trainer" 2>/dev/null; then  # run from the repo root this imports anyway; else install
  "$PY" -m pip install -q -e . --no-deps --no-build-isolation || true
fi
# torchdata and pulp are needed and not in every image: wheels carried in .whl/ are installed offline
if ! "$PY" -c "import torchdata.stateful_dataloader, pulp" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import trainer.trainer" >"$OUT/import.log" 2>&1; then
  echo "the project does not import with this Python (see below; carry missing wheels in .whl/):" >&2
  tail -3 "$OUT/import.log" >&2; exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "no GPU visible to torch: nothing to check" >&2; exit 2
fi
"$PY" -c "import torch; n = torch.cuda.get_device_name(0); '${HARDWARE^^}' in n or \
  print(f'warning: GPU {n} but HARDWARE=${HARDWARE}: MFU and the plan use the ${HARDWARE} profile')"

# ---------------------------------------------------------------- helpers
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1)  # = torchrun, with $PY

# run NAME CAP_S CMD...: CMD under `timeout` (its cap, or less as the deadline nears), output to
# $OUT/NAME.log, "NAME rc seconds" to status.tsv. rc 124/137: timed out; 125: skipped, no time left;
# 126: not asked for (ONLY), neither run nor judged.
run() {
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE - SECONDS)) t0=$SECONDS rc
  local limit=$((cap < left ? cap : left))
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then  # ONLY="a b": run these variants alone
    echo "not run: not in ONLY" >"$OUT/$name.log"; printf '%s\t126\t0\t0\n' "$name" >>"$OUT/status.tsv"; return 0
  fi
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (${left}s left of the budget)"; echo "skipped: out of time" >"$OUT/$name.log"
    printf '%s\t125\t0\t%s\n' "$name" "$limit" >>"$OUT/status.tsv"; return 0
  fi
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1; rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$OUT/status.tsv"
  if [ "$rc" -eq 0 ]; then echo "   ok, $((SECONDS - t0))s"
  else echo "   FAILED (rc $rc), $((SECONDS - t0))s: see $OUT/$name.log"; fi
  return 0
}

COMMON=(--config llama3_debug --checkpoint.enable false --metrics.enable_tensorboard false
        --metrics.log_freq 1 --job.dump_folder "$RUNS" --lr_scheduler.warmup_steps 2)
DEBUG=("${COMMON[@]}" --training.steps "$STEPS" --training.seq_len 512 --training.local_batch_size 8)
# ~1.5B parameters (LLaMA 3.2 1B's shape, untied output); the debug flavor's byte tokenizer and corpus
B1=("${COMMON[@]}" --training.steps "$STEPS_1B" --model.dim 2048 --model.n_layers 16 --model.n_heads 32
    --model.n_kv_heads 8 --model.vocab_size 128256 --model.ffn_hidden_dim 8192 --model.max_seq_len 2048
    --training.seq_len 2048 --training.local_batch_size "$LBS_1B"
    --training.mixed_precision_param bfloat16 --training.mixed_precision_reduce float32
    --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --training.compile true)
GPU=(--job.device cuda --metrics.hardware "$HARDWARE" --parallelism.hardware "$HARDWARE")
# compiled runs log guard failures (recompiles) and graph breaks, counted in the table (an empty
# TORCH_LOGS breaks torch's log setup, so eager runs get none at all)
TLOGS=(env TORCH_LOGS=recompiles,graph_breaks)
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- (a) CPU reference, in the background
# Same job, one process, global batch 8 (~20 s on 4 threads): its losses are what the GPU runs must give.
( run cpu_ref 240 env OMP_NUM_THREADS="$CPU_THREADS" "$PY" train.py "${DEBUG[@]}" --job.device cpu \
    --job.name cpu_ref ) &
CPU_PID=$!

# ---------------------------------------------------------------- (a) debug LLaMA on the GPU
for mode in manual auto; do
  for compile in false true; do
    name="${mode}_$([ "$compile" = true ] && echo compiled || echo eager)"
    cap=$([ "$compile" = true ] && echo 150 || echo 100)
    if [ "$compile" = true ]; then logs=("${TLOGS[@]}"); else logs=(); fi
    run "$name" "$cap" "${logs[@]}" "${TORCHRUN[@]}" train.py "${DEBUG[@]}" "${GPU[@]}" --job.name "$name" \
      --parallelism.mode "$mode" --training.compile "$compile"
  done
done

# ---------------------------------------------------------------- (b)+(c) ~1.5B, compiled, manual vs auto
# Through the profile driver (the same Trainer as train.py, the same step lines): steps 1..N-1 train
# and give tok/s, MFU and memory, step N runs under the profiler -> $OUT/NAME.json.gz, NAME_kernels.txt.
# One run per mode does both: a separate profile run would plan and compile the 1.5B step again.
for mode in manual auto; do
  name="1b_${mode}_compiled"
  run "$name" $([ "$mode" = auto ] && echo 240 || echo 150) "${TLOGS[@]}" \
    "${TORCHRUN[@]}" scripts/gpu_check_profile.py --out "$OUT" --name "$name" --warmup $((STEPS_1B - 1)) \
    "${B1[@]}" "${GPU[@]}" --job.name "$name" --parallelism.mode "$mode"
done

# ---------------------------------------------------------------- (c') optional: debug-shape profiles
# PROFILE_DEBUG=1: also one profiled step of the debug model (3 warm-up steps, compiled; Inductor's
# cache from (a) keeps it short), where launch overheads rather than matmuls show. Skipped when the
# budget is spent.
if [ "${PROFILE_DEBUG:-0}" = 1 ]; then
  for mode in auto manual; do
    run "profile_${mode}_debug" 90 "${TORCHRUN[@]}" scripts/gpu_check_profile.py --out "$OUT" \
      --name "profile_${mode}_debug" --warmup 3 "${DEBUG[@]}" --training.compile true "${GPU[@]}" \
      --job.name "profile_${mode}_debug" --parallelism.mode "$mode"
  done
fi

wait "$CPU_PID"  # its own timeout bounds this

# ---------------------------------------------------------------- table, verdict, packing
"$PY" scripts/gpu_check_report.py --out "$OUT" --runs "$RUNS" --tol 1e-3 2>&1 | tee "$OUT/report.txt"
verdict=${PIPESTATUS[0]}
if [ "$PACK" = 1 ]; then  # <= 8 files in $OUT: report, kernel tables in one file, traces, the rest archived
  (cd "$OUT" && { ! compgen -G "*_kernels.txt" >/dev/null || cat ./*_kernels.txt >kernels.txt; } \
     && tar czf logs.tar.gz --exclude=logs.tar.gz --exclude=report.txt --exclude=kernels.txt --exclude='*.json.gz' ./* \
     && find . -mindepth 1 -maxdepth 1 ! -name logs.tar.gz ! -name report.txt ! -name kernels.txt ! -name '*.json.gz' \
        -exec rm -rf {} +)
fi
echo "gpu_check: $((SECONDS))s in all; results in $OUT"
exit "$verdict"
