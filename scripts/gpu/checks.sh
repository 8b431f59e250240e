#!/bin/bash
# The GPU checks (docs/gpu.md), in order of expected value per device second,
# within one device call:
#   bash scripts/gpu/checks.sh BUDGET_S [dry]
# from the repository root on the device machine (carry: .whl, .gpu/smol.sha256 and, where the tree
# was reduced for a capped transfer, tests/data: tests/conftest.py reads it at import, so without it the
# pytest checks are skipped; and, unless /tmp/smol.gguf is already there from the training run,
# .gpu/smolB after an earlier call carried .gpu/smolA and ran `cat .gpu/smolA > /tmp/smol.gguf`: 64 MiB
# a call). The draft: /tmp/ck if a training run left one there, else the shipped one (without either the
# decode checks are skipped). Each check runs with
# the seconds left as its timeout (none starts with less than its own minimum); its JSON and log go to
# $OUT. `dry` prints the commands and exits (run it here first).
#   1. host round trips per decode round: SmolLM2 + the shipped draft (or /tmp/ck if the
#      training run left a checkpoint there) on 4 chat prompts x 96 tokens, AR / chain / DDTree@22, with
#      --attention live / dense and --rounds 0 / 8, and XLA's WHILE / CONDITIONAL command buffers;
#   2. the Mosaic GPU Q4_K / Q5_K / Q6_K kernel: on-device tests (the kernel alone at 5 shapes x 2 WGMMA
#      operand placements x 3 formats, and in the tiny hybrid model; the interpret-mode cases
#      CI runs are left out), then its table at M = 1..64;
#   3. the outputs-only tree Gated DeltaNet kernel: tests, then the 27B-shaped e2e with replay;
#   4. the 27B-shaped random model end to end: pallas vs pallas_dense vs mosaic;
#   4b. the 27B-shaped random model's batched AR step, B = 1 / 4 / 16 / 64 rows, Pallas vs reference
#      kernels (the kernels run once on the batch's rows under the loop's vmap);
#   5. a Qwen3.5-35B-A3B-shaped MoE FFN: tests/test_moe.py, then its table (both expert
#      paths, Pallas vs reference kernels, T = 1 .. 64);
#   6. the MTP draft: the 27B-shaped random model with an MTP block: 3 block steps + a chain-4 verify against an AR step (the break-even
#      acceptance length of `--draft mtp` on this GPU);
#   7. mode="auto"'s table for this GPU kind: SmolLM2 + the draft at B = 1 and 8, every
#      mode, written as an auto-mode table to ship (without one, auto decodes AR on a GPU).
set -u
BUDGET=${1:?BUDGET_S}
DRY=${2:-}
OUT=${OUT:-/tmp/out}
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }

run() {   # run NAME MIN_S CMD...: CMD with the time left as its timeout, output to $OUT/NAME.log
  local name=$1 min=$2
  shift 2
  if [ -n "$DRY" ]; then echo "[$name, >= ${min}s] $*"; return; fi
  if [ "$(left)" -lt "$min" ]; then echo "skip $name: $(left) s left" | tee -a "$OUT/checks.txt"; return; fi
  local t=$SECONDS
  timeout "$(left)" bash -c "$*" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t)) s" | tee -a "$OUT/checks.txt"
  tail -c 6000 "$OUT/$name.log" > "$OUT/$name.tail" && mv "$OUT/$name.tail" "$OUT/$name.log"
}

needs() {  # needs PATH NAME MIN_S CMD...: run, where PATH (carried data the check reads) is here
  local path=$1
  shift
  if [ -z "$DRY" ] && [ ! -e "$path" ]; then
    echo "skip $1: $path is not here (carry it)" | tee -a "$OUT/checks.txt"
    return
  fi
  run "$@"
}

if [ -z "$DRY" ]; then
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  if ! echo "$(cat .gpu/smol.sha256)  /tmp/smol.gguf" | sha256sum -c --quiet > /dev/null 2>&1; then
    # the GGUF's first piece carried alone by an earlier call (`cat .gpu/smolA > /tmp/smol.gguf`,
    # an earlier call) or in this one, then the second piece
    [ -f .gpu/smolA ] && cat .gpu/smolA > /tmp/smol.gguf
    [ -f .gpu/smolB ] && cat .gpu/smolB >> /tmp/smol.gguf
    echo "$(cat .gpu/smol.sha256)  /tmp/smol.gguf" | sha256sum -c || exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/checks.txt"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
DRAFT=checkpoints/smollm2-135m-instruct-dflash
[ -f /tmp/ck/model.safetensors ] && DRAFT=/tmp/ck
B="python3 scripts/bench.py --target /tmp/smol.gguf --draft $DRAFT --dataset chat --n_prompts 4 \
--n_gen 96 --repeats 1 --modes ar,chain,ddtree --budgets 22 --nollama_cpp"
CMDBUF="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"

needs "$DRAFT/model.safetensors" syncs_live_r0 90 "$B --json_out $OUT/syncs_live_r0.json"
needs "$DRAFT/model.safetensors" syncs_dense_r8 90 "$B --attention dense --rounds 8 --json_out $OUT/syncs_dense_r8.json"
needs "$DRAFT/model.safetensors" syncs_live_r0_cmdbuf 90 "XLA_FLAGS=$CMDBUF $B --json_out $OUT/syncs_live_r0_cmdbuf.json"
needs "$DRAFT/model.safetensors" syncs_dense_r0 90 "$B --attention dense --json_out $OUT/syncs_dense_r0.json"
needs tests/data/dflash_tiny pytest_mgpu 120 "python3 -m pytest -q tests/test_mgpu.py -k 'on_gpu or lowers_for_cuda'"
run mgpu_table 150 "python3 scripts/bench_kernels.py --tables=mgpu --formats=q4_k,q6_k,q5_k --ms=1,16,23,32,64 \
--mgpu_stages=2,3,4 --mgpu_operands=registers,smem --e2e= --repeats 10 --json_out $OUT/mgpu.json"
needs tests/data/dflash_tiny pytest_tree_replay 120 "python3 -m pytest -q tests/test_kernels.py -k 'tree_gdn or model_with_pallas or folds'"
run e2e_27b 240 "python3 scripts/bench_kernels.py --tables=tree_gdn \
--e2e=pallas,pallas_dense,pallas_replay,mosaic --repeats 10 --json_out $OUT/e2e_27b.json"
run e2e_batched 200 "python3 scripts/bench_kernels.py --tables= --e2e=pallas,reference \
--e2e_batches=1,4,16,64 --repeats 10 --json_out $OUT/e2e_batched.json"
needs tests/data/dflash_tiny pytest_moe 60 "python3 -m pytest -q tests/test_moe.py -k 'float64 or pallas or lowers'"
run moe_35b 90 "python3 scripts/bench_kernels.py --tables=moe --ms=1,16,23,64 --e2e= --repeats 10 \
--json_out $OUT/moe_35b.json"
run e2e_mtp 200 "python3 scripts/bench_kernels.py --tables= --e2e=pallas_mtp --repeats 10 \
--json_out $OUT/e2e_mtp.json"
# 7. mode="auto"'s table for this GPU kind: auto looks the mode up by platform:device kind,
#    target file name and draft directory name, and without an entry it decodes AR, so on a GPU it never
#    uses the draft until a table is shipped. The names the key needs are given by links. Merge
#    $OUT/auto_modes_gpu.json into dflash_jax/auto_modes.json only if the measured draft is the shipped one
#    (auto_table.json's "draft"; DRAFT is /tmp/ck after a training run).
TBL=""
[ -f checkpoints/train_data/smollm2-135m-instruct/manifest.json ] &&
  TBL="--lookup_table checkpoints/train_data/smollm2-135m-instruct --table_expects 2"
if [ -z "$DRY" ]; then
  ln -sf /tmp/smol.gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p /tmp/auto && ln -sfn "$(realpath "$DRAFT")" /tmp/auto/smollm2-135m-instruct-dflash
fi
needs "$DRAFT/model.safetensors" auto_table 300 "python3 scripts/bench.py \
--target /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --draft /tmp/auto/smollm2-135m-instruct-dflash \
--dataset chat --n_prompts 16 --n_gen 64 --repeats 1 --batch_sizes 1,8 --modes ar,lookup,chain,ddtree \
--budgets 8,22 --lookups 4 $TBL --nollama_cpp --auto_table $OUT/auto_modes_gpu.json \
--json_out $OUT/auto_table.json"
[ -z "$DRY" ] && ls -l "$OUT"
