#!/bin/bash
# The GPU data + draft-training run (docs/gpu.md), over device calls:
#   bash scripts/gpu/train_run.sh GEN_MIN END_S WAIT_S [GEN_BATCH SHARD MAX_NEW TRAIN_BATCH LAYERS DTYPE PACK]
# from the repository root on the device machine, once /tmp/smol.gguf holds the GGUF's first piece
# (carry: .whl, .gpu/smolB, .gpu/smol.sha256, .gpu/prompts.npz, the shipped draft).
# Launches, detached (setsid), one pipeline:
#   1. the target answers the carried prompts (.gpu/prompts.npz, written here by gen_data.py
#      --export_prompts, so the GPU answers the same corpus indices as this machine) greedily from
#      the first prompt no committed greedy shard answered (gen_data resumes from the manifest),
#      with GEN_BATCH rows at once, for GEN_MIN minutes (0: no generation at all), then (if the prompts ran out first)
#      sampled at temperature 0.8 (seed 1000, as the committed sampled shards), as new shards in a
#      copy of the committed data directory;
#   2. trains from the shipped draft on all of it (committed + new shards) until END_S seconds
#      after the launch (--fit_schedule ends the cosine schedule there); LAYERS (optional): the
#      draft's depth (train_draft.py --draft_layers: fewer keeps the first layers, more grows it
#      with identity-initialised layers); DTYPE (optional, default bfloat16): the training step's
#      compute dtype (bf16 operands on the tensor cores, float32 accumulation; float32 = the
#      H100 runs' setting, 0.400 s a step at batch 32); PACK (optional, default 1024): packed rows of
#      PACK tokens (train_draft.py --pack: several whole sequences back to back per row, each seeing
#      only itself, ~78 % real tokens at 1024; TRAIN_BATCH is then rows a step, by default from the
#      GPU's memory (nvidia-smi: >= 70,000 MiB 24 rows (an H200, or an H100 80GB with
#      the fused loss); else or without nvidia-smi 12; an empty argument "" keeps
#      that default), and the
#      anchors scale to 96 per 400 tokens, 96 per average sequence), 0: one sequence per 800-token
#      row (TRAIN_BATCH default 32, ~49 % real tokens).
# Waits at most WAIT_S seconds (or until the training ends), then copies to $OUT what exists: the
# data directory (data.tgz), the checkpoint in 15 MB pieces ($OUT takes files <= 16 MiB, 8 files),
# its config and log, run.log, status.txt and (once the training ended, if the checkpoint is in at
# most two pieces) the compile cache.
# A later call with GEN_MIN=-1 only waits and copies.
set -u
GEN_MIN=${1:-4}
END_S=${2:-760}
WAIT=${3:-560}
GB=${4:-256}
SHARD=${5:-1024}
MAXNEW=${6:-512}
TB=${7:-}
LAYERS=${8:-}
DTYPE=${9:-bfloat16}
PACK=${10:-1024}
if [ "$PACK" -gt 0 ]; then
  if [ -z "$TB" ]; then   # rows a step from the GPU's memory (XLA's estimate with the fused
    # loss: 2.2 GB a packed row of 1024, 24 rows 53.6 GB; the materialized loss: 101 GB)
    MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -n 1)
    MEM=${MEM%%.*}; MEM=${MEM//[^0-9]/}
    if [ "${MEM:-0}" -ge 70000 ]; then TB=24       # H100 80 GB, H200 141 GB 
    else TB=12; fi
    echo "TRAIN_BATCH $TB (GPU memory ${MEM:-unknown} MiB)"
  fi
  SHAPE="--pack --seq_len $PACK --anchors $(( PACK * 96 / 400 ))"
else
  TB=${TB:-32}
  SHAPE="--seq_len 800 --anchors 96"
fi
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
if [ "$GEN_MIN" != -1 ]; then
  [ -f .gpu/smolB ] && cat .gpu/smolB >> /tmp/smol.gguf
  echo "$(cat .gpu/smol.sha256)  /tmp/smol.gguf" | sha256sum -c || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  rm -rf /tmp/repo /tmp/data /tmp/ck /tmp/gen.done /tmp/train.done && mkdir /tmp/repo
  cp -r dflash_jax pallas_kernels scripts checkpoints /tmp/repo/
  [ -f .gpu/prompts.npz ] && cp .gpu/prompts.npz /tmp/repo/     # carried only with generation
  cp -r checkpoints/train_data/smollm2-135m-instruct /tmp/data
  [ -f .gpu/jcache.tgz ] && tar xzf .gpu/jcache.tgz -C /tmp     # a carried compilation cache
  SEED=$(( $(date +%s) % 100000 ))      # the batch order; recorded in train_log.json
  END_EPOCH=$(( $(date +%s) + END_S ))
  GEN_END=$(python3 -c "import time; print(int(time.time() + 60 * $GEN_MIN))")
  cat > /tmp/pipe.sh << EOF
cd /tmp/repo || exit 1
G="python3 scripts/gen_data.py --target /tmp/smol.gguf --weights f32 --data_dir /tmp/data
   --prompts_file prompts.npz --batch_size $GB --max_new_tokens $MAXNEW --max_ctx 800
   --shard_prompts $SHARD --compile_cache_dir /tmp/jcache"
if [ "$GEN_MIN" != 0 ]; then                # GEN_MIN 0: no generation, train on the carried data
  \$G --temperature 0 --minutes $GEN_MIN   # resumes after the last greedy prompt answered
fi
REM=\$(( $GEN_END - \$(date +%s) ))
if [ \$REM -gt 30 ]; then
  \$G --temperature 0.8 --seed 1000 --minutes \$(python3 -c "print(\$REM / 60)")
fi
touch /tmp/gen.done
TMIN=\$(python3 -c "print(max(1.5, ($END_EPOCH - \$(date +%s)) / 60))")
python3 scripts/train_draft.py --target /tmp/smol.gguf --out_dir /tmp/ck \
  --init_checkpoint checkpoints/smollm2-135m-instruct-dflash --data_dirs /tmp/data \
  --steps 4000 --batch $TB $SHAPE --length_buckets= --restrict_vocab \
  --lr 3e-4 --warmup 50 --gamma 7 --kl_weight 0.5 --eval_every 0 --save_every 100 --n_eval 0 \
  --compute_dtype $DTYPE --seed $SEED --minutes \$TMIN --fit_schedule \
  --compile_cache_dir /tmp/jcache ${LAYERS:+--draft_layers $LAYERS}
touch /tmp/train.done
EOF
  setsid nohup bash /tmp/pipe.sh > /tmp/run.log 2>&1 &
fi
while [ ! -f /tmp/train.done ] && [ $((SECONDS - T0)) -lt "$WAIT" ]; do
  sleep 5
done
{ tr '\r' '\n' < /tmp/run.log | grep -v "^training: "; tr '\r' '\n' < /tmp/run.log | grep "^training: " |
  awk 'NR % 50 == 0'; } | tail -c 14000 > "$OUT/run.log"     # the log's lines, every 50th progress line
tr '\r' '\n' < /tmp/run.log | tail -n 3
{ echo "elapsed_s $((SECONDS - T0))"; ls /tmp/gen.done /tmp/train.done 2> /dev/null; } > "$OUT/status.txt"
[ -f /tmp/gen.done ] && tar czf "$OUT/data.tgz" -C /tmp data
cp /tmp/ck/config.json /tmp/ck/train_log.json "$OUT/" 2> /dev/null
# XLA's compiled programs (generation and the training step; ~3.5 min of compiling on an H100): a
# later run with the same code, JAX and GPU kind may carry them back (.gpu/jcache.tgz).
CK_BYTES=$(stat -c %s /tmp/ck/model.safetensors 2> /dev/null || echo 0)
[ -f /tmp/train.done ] && [ "$CK_BYTES" -le 31457280 ] && tar czf /tmp/jcache.tgz -C /tmp jcache 2> /dev/null &&
  [ "$(stat -c %s /tmp/jcache.tgz)" -lt 16000000 ] && cp /tmp/jcache.tgz "$OUT/"
[ -f /tmp/ck/model.safetensors ] && split -b 15M -d /tmp/ck/model.safetensors "$OUT/model.part."
ls -l "$OUT"
[ -f /tmp/train.done ] && echo "FINISHED" || echo "STILL RUNNING"
