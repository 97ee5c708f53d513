#!/usr/bin/env bash
# Everything that needs a GPU, run from a bundle (make bundle) on a GPU node, each step's log in
# OUT_DIR: `unit` the gpu unit tests, `regression` the loss curves with CUDA compute, `bench`
# scripts/bench_gpu.sh (each model beside PyTorch), `attention` the two attention implementations side
# by side, `hf` our Hugging Face and PEFT exports in the real transformers and peft
# (scripts/hf_check.py; the node's python3 has them, this machine's may not).
#
#   scripts/gpu_check.sh BUNDLE_DIR OUT_DIR [unit] [regression] [bench] [attention] [hf]
#                                          (default: unit, regression and bench)
#   DATA=PREFIX     the dataset of regression and hf (a copy of build/regression/data/fortunes: the
#                   node has no fortune files to prepare it from)
#   PYTHON=...      bench and hf: the python3 that has torch, transformers and peft (default: python3)
#   MODELS=...      bench and attention: the inputs/*_gpu.ini models (default: all four)
#   ARGS=...        bench: more options for every run (scripts/bench_gpu.sh)
#   STEP_TIMEOUT=S  seconds each step may run before it is killed and reported failed (exit 124), so
#                   that a kernel that hangs costs one step, not the session (default: none)
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUNDLE_DIR OUT_DIR [unit] [regression] [bench] [attention] [hf]" >&2; exit 2; }
mkdir -p "$2"
B=$(cd "$1" && pwd) OUT=$(cd "$2" && pwd)
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(unit regression bench)
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODELS=${MODELS:-gpt2_124m gpt2_350m gpt2_1p3b llama_1b}
status=0
step() {  # name command...: runs it, its output to OUT/name.log, and reports the exit status
  local name=$1 t0=$SECONDS rc
  shift
  if declare -F "$1" >/dev/null; then  # a function of this script (its commands are timed out by it)
    "$@" >"$OUT/$name.log" 2>&1
  else
    timeout -k 10 "${STEP_TIMEOUT:-0}" "$@" >"$OUT/$name.log" 2>&1
  fi
  rc=$?
  echo "gpu_check: $name exit $rc ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
}
# Resuming is exact on the GPU: two ranks sharing it, bf16, the distributed optimizer, stopped at
# iteration 2 and resumed, must give iterations 3 and 4 the uninterrupted run's gradient norms and
# losses. GEMM autotuning off: it may choose other algorithms in the second run.
resume_check() {
  local dir=$OUT/resume run pat='"grad_norm":[^,]*,"iter":[34],"loss":[^,]*'
  rm -rf "$dir" && mkdir -p "$dir" || return 1
  run=(timeout -k 10 "${STEP_TIMEOUT:-0}" "$B/run" mpirun -np 2 --oversubscribe --bind-to none mpigpt train
       --model.num_layers 2 --model.hidden 64 --model.num_heads 1 --model.seq_len 64 --training.micro_batch 2
       --training.global_batch 8 --training.log_interval 1 --training.lr 1e-3 --training.warmup_iters 2
       --training.train_iters 4 --training.precision bf16 --engine.distributed_optimizer true --data.path "$DATA"
       $shared --engine.gemm_autotune false)
  "${run[@]}" --checkpoint.save "$dir/a" --checkpoint.save_interval 2 --training.metrics_file "$dir/a.jsonl" &&
    "${run[@]}" --checkpoint.load "$dir/a/iter_0000002" --training.metrics_file "$dir/b.jsonl" || return 1
  grep -o "$pat" "$dir/a.jsonl" >"$dir/a.txt"
  grep -o "$pat" "$dir/b.jsonl" >"$dir/b.txt"
  cat "$dir/a.txt" "$dir/b.txt"
  [ "$(wc -l <"$dir/a.txt")" = 2 ] && diff "$dir/a.txt" "$dir/b.txt" && echo "resume: iterations 3 and 4 equal"
}
"$B/run" nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
for part in "${parts[@]}"; do
  case $part in
    unit)
      step unit "$B/run" mpigpt_tests "--source-file=*/cuda/*_test.cpp" "--source-file-exclude=*_np2_test.cpp" \
        --no-version=true
      step unit_np2 "$B/run" mpirun -np 2 --oversubscribe --bind-to none mpigpt_tests \
        "--source-file=*/cuda/*_np2_test.cpp" --no-version=true ;;
    regression)
      [ -n "${DATA:-}" ] || { echo "gpu_check: regression needs DATA=PREFIX" >&2; status=1; continue; }
      common=(--binary "$B/bin/mpigpt" --mpirun "mpirun --oversubscribe --bind-to none" --data "$DATA"
              --require-gpu --with-one-rank)
      shared="--engine.backend cuda --engine.comm mpi --engine.allow_device_sharing true"
      step regression_fp32 "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" --out "$OUT/reg_fp32" \
        --layouts "^(dp2|tp2|pp2|cp2|moe-ep2)$" --families gpt2,llama,qwen2,gpt2-moe,llama-moe --layout-args "$shared"
      step regression_bf16 "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" --out "$OUT/reg_bf16" \
        --layouts "^(moe-ep2|tp2-dp2-distopt)$" --families gpt2,gpt2-moe,llama-moe --steps 50 --skip-reference \
        --tol 2e-2 --layout-args "$shared --training.precision bf16"
      step resume_bf16 resume_check
      # One head of 64 channels and 128 tokens (as regression/regression.cmake's tiny_hd64.ini), so that
      # the attention runs on the kernels of head dim 64, with each implementation (cuDNN 9.15 and older
      # run the backward only for a sequence length that is a multiple of 128).
      sed -e 's/^num_heads = 4$/num_heads = 1/' -e 's/^seq_len = 32$/seq_len = 128/' "$SRC/regression/tiny.ini" \
        >"$OUT/tiny_hd64.ini"
      for backend in builtin cudnn; do
        step "regression_bf16_hd64_$backend" "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" \
          --out "$OUT/reg_bf16_hd64_$backend" --config "$OUT/tiny_hd64.ini" --layouts "^$" --families gpt2 \
          --steps 50 --skip-reference --tol 2e-2 \
          --layout-args "$shared --training.precision bf16 --engine.attention_backend $backend"
      done ;;
    bench)
      configs=()
      for model in $MODELS; do configs+=("$SRC/inputs/${model}_gpu.ini"); done
      step bench env MPIGPT="$B/run mpigpt" LOG="$OUT/bench_runs.log" ARGS="${ARGS:-}" PYTORCH="${PYTHON:-python3}" \
        "$SRC/scripts/bench_gpu.sh" "${configs[@]}" ;;
    attention)
      # Each implementation alone at the model's shape (`mpigpt bench-attention`) and in a training
      # step, micro-batch 64 (Llama 1B: 32), no recompute; each in a process of its own.
      for model in $MODELS; do
        mb=64
        [ "$model" = llama_1b ] && mb=32
        for backend in builtin cudnn; do
          step "kernels_${model}_$backend" "$B/run" mpigpt bench-attention --config "$SRC/inputs/${model}_gpu.ini" \
            --training.micro_batch $mb --bench-steps 20 --bench-warmup 5 --engine.attention_backend $backend
          step "attention_${model}_$backend" "$B/run" mpigpt bench --config "$SRC/inputs/${model}_gpu.ini" \
            --training.micro_batch $mb --training.global_batch $mb --engine.recompute none --bench-steps 10 \
            --bench-warmup 3 --engine.attention_backend $backend
        done
      done
      for log in "$OUT"/kernels_*.log "$OUT"/attention_*.log; do  # the lines that matter, last
        echo "== $(basename "$log" .log)"
        grep -E "bench-attention: (forward|attention)|bench: (achieved|attention)|rror" "$log" | cut -c1-300 | head -8
      done ;;
    hf)
      [ -n "${DATA:-}" ] || { echo "gpu_check: hf needs DATA=PREFIX" >&2; status=1; continue; }
      # The node's own python (torch loads its libraries, not the bundle's); mpigpt through ./run.
      read -ra py <<<"${PYTHON:-python3}"
      step hf "${py[@]}" "$SRC/scripts/hf_check.py" --mpigpt "$B/run mpigpt" --data "$DATA" --out "$OUT/hf" ;;
    *) echo "gpu_check: unknown part $part (unit, regression, bench, attention, hf)" >&2; exit 2 ;;
  esac
done
exit $status
