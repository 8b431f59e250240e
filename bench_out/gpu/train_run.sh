#!/bin/bash
# The GPU draft-training run of issue 24 (bench_out/gpu/TRAIN_RUN.md), one device call:
#   bash bench_out/gpu/train_run.sh MINUTES WAIT_S
# from the repository root on the device machine, once /tmp/smol.gguf has been assembled there
# (carry: .whl, .gpu/smolB, .gpu/smol.sha256, checkpoints/smollm2-135m-instruct-dflash).
# Trains from the shipped draft on the committed token shards for MINUTES (the cosine schedule
# fitted to them, --fit_schedule), detached (setsid), waits for it at most WAIT_S seconds, then
# copies what exists to $OUT: the checkpoint split in 12 MB pieces ($OUT takes files <= 16 MiB),
# its config and log, and the checkpoint as it was after ~half the run (mid_*).
# A second call with MINUTES=0 only waits and copies.
set -u
MIN=${1:-8}
WAIT=${2:-540}
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
if [ "$MIN" != 0 ]; then
  [ -f .gpu/smolB ] && cat .gpu/smolB >> /tmp/smol.gguf
  echo "$(cat .gpu/smol.sha256)  /tmp/smol.gguf" | sha256sum -c || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  rm -rf /tmp/repo && mkdir /tmp/repo && cp -r dflash_jax pallas_kernels scripts checkpoints /tmp/repo/
  cd /tmp/repo || exit 1
  setsid nohup python3 scripts/train_draft.py --target /tmp/smol.gguf --out_dir /tmp/ck \
    --init_checkpoint checkpoints/smollm2-135m-instruct-dflash \
    --data_dirs checkpoints/train_data/smollm2-135m-instruct \
    --steps 4000 --batch 32 --anchors 96 --seq_len 800 --length_buckets= --restrict_vocab \
    --lr 3e-4 --warmup 50 --gamma 7 --kl_weight 0.5 --eval_every 0 --save_every 100 --n_eval 0 \
    --compute_dtype float32 --seed 26 --minutes "$MIN" --fit_schedule > /tmp/run.log 2>&1 &
  echo $! > /tmp/run.pid
  cd - > /dev/null
fi
pid=$(cat /tmp/run.pid)
mid_done=0
while kill -0 "$pid" 2> /dev/null && [ $((SECONDS - T0)) -lt "$WAIT" ]; do
  sleep 5
  if [ $mid_done = 0 ] && [ "$MIN" != 0 ] && [ $((SECONDS - T0)) -gt $((MIN * 30)) ] &&
     [ -f /tmp/ck/model.safetensors ]; then
    mkdir -p /tmp/mid && cp /tmp/ck/config.json /tmp/ck/model.safetensors /tmp/mid/ && mid_done=1
  fi
done
{ tr '\r' '\n' < /tmp/run.log | grep -v "^training: "; tr '\r' '\n' < /tmp/run.log | grep "^training: " |
  awk 'NR % 50 == 0'; } | tail -c 12000 > "$OUT/run.log"     # the log's lines, every 50th progress line
tr '\r' '\n' < /tmp/run.log | tail -n 3
cp /tmp/ck/config.json /tmp/ck/train_log.json "$OUT/" 2> /dev/null
[ -f /tmp/ck/model.safetensors ] && split -b 12M -d /tmp/ck/model.safetensors "$OUT/model.part."
if [ -f /tmp/mid/model.safetensors ]; then
  cp /tmp/mid/config.json "$OUT/mid_config.json"
  split -b 12M -d /tmp/mid/model.safetensors "$OUT/mid_model.part."
fi
ls -l "$OUT"
kill -0 "$pid" 2> /dev/null && echo "STILL RUNNING" || echo "FINISHED"
