#!/usr/bin/env bash
# The GPU path, checked on one GPU machine: the debug LLaMA trained for 20 steps in manual
# (FSDP) and auto mode, eager and compiled, with NCCL on every GPU of this machine; prints
# tokens/s, MFU, peak memory and whether the losses match a CPU run of the same job.
#
#   bash scripts/gpu_check.sh                # all GPUs of the machine, h100 profile for MFU
#   HARDWARE=h200 STEPS=20 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-20}
HARDWARE=${HARDWARE:-h100}
NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
OUT=${OUT:-outputs/gpu_check}
if [ "$NGPU" -lt 1 ]; then echo "no GPU visible to torch: nothing to check" >&2; exit 2; fi
GLOBAL_BATCH=8
if [ $((GLOBAL_BATCH % NGPU)) -ne 0 ]; then GLOBAL_BATCH=$NGPU; fi
LOCAL=$((GLOBAL_BATCH / NGPU))
COMMON=(--config llama3_debug --training.steps "$STEPS" --training.seq_len 512 --checkpoint.enable false
        --metrics.log_freq 5 --metrics.enable_tensorboard false --job.dump_folder "$OUT" --lr_scheduler.warmup_steps 2)
mkdir -p "$OUT"

echo "== CPU reference (1 process, global batch $GLOBAL_BATCH)"
python train.py "${COMMON[@]}" --job.device cpu --job.name cpu --training.local_batch_size "$GLOBAL_BATCH" \
    > "$OUT/cpu.log" 2>&1

for mode in manual auto; do
  for compile in false true; do
    name="${mode}_$([ "$compile" = true ] && echo compiled || echo eager)"
    echo "== $name on $NGPU GPU(s), local batch $LOCAL"
    torchrun --standalone --nproc_per_node="$NGPU" train.py "${COMMON[@]}" --job.device cuda --job.name "$name" \
        --parallelism.mode "$mode" --training.compile "$compile" --training.local_batch_size "$LOCAL" \
        --metrics.hardware "$HARDWARE" --parallelism.hardware "$HARDWARE" > "$OUT/$name.log" 2>&1 \
        || echo "   $name FAILED: see $OUT/$name.log"
  done
done

python - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
def losses(name):
    p = out / name / "losses.json"
    return {int(k): v for k, v in json.loads(p.read_text())["loss"].items()} if p.exists() else {}
ref = losses("cpu")
print(f"\n{'variant':<16} {'tok/s':>9} {'MFU':>7} {'peak mem':>10}  losses vs CPU (max rel diff)")
for name in ("manual_eager", "manual_compiled", "auto_eager", "auto_compiled"):
    log = (out / f"{name}.log").read_text() if (out / f"{name}.log").exists() else ""
    last = [m for m in re.finditer(r"tok/s (\d+) \| mfu ([\d.]+%|n/a) \| mem ([\d.]+) GiB", log)]
    tps, mfu, mem = (last[-1].groups() if last else ("-", "-", "-"))
    got = losses(name)
    common = sorted(set(got) & set(ref))
    diff = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in common), default=float("nan"))
    verdict = "match" if common and diff < 1e-3 else ("FAILED" if not common else "differ")
    print(f"{name:<16} {tps:>9} {mfu:>7} {mem:>8} GiB  {verdict} ({diff:.1e} over {len(common)} steps)")
PY
