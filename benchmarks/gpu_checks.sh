#!/usr/bin/env bash
# The checks run on one NVIDIA H100 on 2026-11-22 (docs/verification.md, "On a GPU"), in one command on
# a GPU node with zoo installed (`make setup`, then `. .venv/bin/activate`). About 6 minutes on an H100.
#   1. launch/smoke.py on every GPU of the node (parity, generation, fp16/bf16 steps with FusedAdam,
#      the fp16-vs-bf16 loss-scale check, a checkpoint round trip, a BERT loop);
#   2. gpt2-medium pretraining with ds_configs/tp1.json's recipe shortened to 20 iterations of 32 x 1024
#      tokens (4 warm-up steps), in fp16 and in bf16: the two loss curves side by side;
#   3. the fp16 run stopped by --exit-interval 10 and resumed: losses against the uninterrupted run;
#   4. export of the fp16 run and transformers parity on the GPU (benchmarks/gpu_export_parity.py);
#   5. benchmarks/bench_gpu_step.py (zoo vs transformers, one training step).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-checks}
GPUS=$(nvidia-smi -L | grep -c GPU)
mkdir -p "$OUT"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
config = json.load(open("ds_configs/tp1.json"))
config.update(train_batch_size=32, train_micro_batch_size_per_gpu=8, steps_per_print=10 ** 9)
config["scheduler"]["params"].update(total_num_steps=20, warmup_num_steps=4)
config["zoo"].update(model="gpt2-medium", train_iters=20, log_interval=1, eval_interval=10, eval_iters=2,
                     save_interval=10, save=f"{out}/fp16")
json.dump(config, open(f"{out}/fp16.json", "w"), indent=1)
del config["fp16"]
config["bf16"] = {"enabled": True}
json.dump(config, open(f"{out}/bf16.json", "w"), indent=1)
PY
deepspeed --num_gpus "$GPUS" launch/smoke.py
PRETRAIN="deepspeed --num_gpus 1 launch/pretrain.py"
$PRETRAIN --deepspeed_config "$OUT/fp16.json" --save "$OUT/fp16"
$PRETRAIN --deepspeed_config "$OUT/bf16.json" --save "$OUT/bf16"
$PRETRAIN --deepspeed_config "$OUT/fp16.json" --save "$OUT/preempted" --exit-interval 10
$PRETRAIN --deepspeed_config "$OUT/fp16.json" --save "$OUT/preempted" --load "$OUT/preempted"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def losses(run):
    return {e["iteration"]: e for e in map(json.loads, open(f"{out}/{run}/metrics.jsonl")) if "loss" in e}
fp16, bf16, resumed = losses("fp16"), losses("bf16"), losses("preempted")
print("iteration | fp16 loss, grad norm | bf16 loss, grad norm | fp16 stopped at 10 and resumed: loss, diff")
for it in sorted(fp16):
    print(f"{it:9d} | {fp16[it]['loss']:.4f} {fp16[it]['grad_norm']:8.3f} | {bf16[it]['loss']:.4f} {bf16[it]['grad_norm']:8.3f}"
          f" | {resumed[it]['loss']:.6f} {abs(resumed[it]['loss'] - fp16[it]['loss']):.1e}")
PY
python launch/export.py --load "$OUT/fp16" --out "$OUT/fp16-hf"
python benchmarks/gpu_export_parity.py "$OUT/fp16-hf"
python benchmarks/bench_gpu_step.py
