#!/usr/bin/env bash
# Everything that needs a GPU, run from a bundle (make bundle) on a GPU node, each part's log in
# OUT_DIR: `unit` the gpu unit tests (every CUDA op against the CPU op, NCCL on one rank, two
# ranks sharing the GPU over staged MPI), `regression` the loss curves with CUDA compute (fp32
# layouts and 50 bf16 steps against the CPU curves, as regression/regression.cmake's gpu tests),
# `bench` scripts/bench_gpu.sh, `attention` the attention variants against each other (kernels
# alone and training steps).
#
#   scripts/gpu_check.sh BUNDLE_DIR OUT_DIR [unit] [regression] [bench] [attention]
#                                          (default: unit, regression and bench)
#   DATA=PREFIX   the regression's dataset (PREFIX.bin/.idx, e.g. a copy of build/regression/data/
#                 fortunes: the node has no fortune files to prepare it from)
#   MODELS=...    attention: the inputs/*_gpu.ini models (default gpt2_124m gpt2_1p3b llama_1b)
#   ROUNDS=N      attention: rounds of the alternated variants (default 1)
#   KERNELS=...   attention: the settings timed alone (default "builtin cudnn wgmma wgmma_wg2 auto"; a
#                 name ending in _wg2 runs the warpgroup backward's two-buffer variant at head dim 64)
#   TRAIN=...     attention: the settings of the training steps (default "builtin cudnn wgmma auto"; a
#                 setting is any engine.attention_backend value, e.g. builtin,cudnn: auto among those)
#   STEP_TIMEOUT=S  seconds each command may run before it is killed and reported failed (exit 124):
#                 a kernel that hangs costs one step, not the session (default none; attention 150)
#   PROBE_TIMEOUT=S seconds for each command of the warpgroup probe (default 60)
#
# The warpgroup (wgmma) attention kernels are probed once, before the first step that would run
# them (unit, a wgmma/auto setting, ARGS of the bench): the primitives against exact products
# (cuda_mma), then the kernels once at the 124M and 1.3B shapes. A probe that fails or hangs is
# reported failed, and the rest runs without them: their unit tests are not run, wgmma and
# wgmma_wg2 settings are left out, auto becomes builtin,cudnn and lists lose wgmma. A faulting
# kernel takes its process's CUDA context, and a hanging one its step's timeout, in every step
# that runs it; the probe pays that once. On a GPU of another compute capability than 9.0 there
# is nothing to probe: only the explicit wgmma settings are left out.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUNDLE_DIR OUT_DIR [unit] [regression] [bench] [attention]" >&2; exit 2; }
mkdir -p "$2"
B=$(cd "$1" && pwd) OUT=$(cd "$2" && pwd)
shift 2
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(unit regression bench)
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
step() {  # name command...: runs it, its output to OUT/name.log, and reports the exit status
  local name=$1
  shift
  local t0=$SECONDS rc
  if declare -F "$1" >/dev/null; then  # a function of this script (its commands are timed out by it)
    "$@" >"$OUT/$name.log" 2>&1
  else
    timeout -k 10 "${STEP_TIMEOUT:-0}" "$@" >"$OUT/$name.log" 2>&1
  fi
  rc=$?
  echo "gpu_check: $name exit $rc ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
  return $rc
}
# The warpgroup probe (above); wgmma is empty until it has run, then ok, failed, or absent on a GPU
# that runs no sm_90a code (compute capability other than 9.0): auto and lists skip the kernels
# there by themselves, and an explicit wgmma setting is an error, so only those are left out.
wgmma=
wgmma_probe() {
  local t=${PROBE_TIMEOUT:-60} model
  timeout -k 10 "$t" "$B/run" mpigpt_tests "--source-file=*/cuda/cuda_mma_test.cpp" --no-version=true || return
  for model in gpt2_124m gpt2_1p3b; do
    timeout -k 10 "$t" "$B/run" mpigpt bench-attention --config "$SRC/inputs/${model}_gpu.ini" \
      --training.micro_batch 2 --bench-steps 1 --bench-warmup 1 --engine.attention_backend wgmma || return
  done
}
probe_wgmma() {
  [ -z "$wgmma" ] || return 0
  local cc
  cc=$("$B/run" nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
  if [[ $cc =~ ^[0-9]+\.[0-9]+$ ]] && [ "$cc" != 9.0 ]; then  # (not known: probe)
    wgmma=absent
    echo "gpu_check: the GPU's compute capability is $cc, not 9.0: no warpgroup (sm_90a) kernels to probe"
  else
    step wgmma_probe wgmma_probe && wgmma=ok || wgmma=failed
  fi
}
uses_wgmma() {  # setting...: whether any of the attention settings runs the warpgroup kernels
  local s
  for s in "$@"; do
    case ,$s, in *,auto,* | *,wgmma,* | *,wgmma_wg2,*) return 0 ;; esac
  done
  return 1
}
# settings VAR setting...: VAR = the attention settings as they may run: unchanged where none uses
# wgmma or the probe (run here if it has not yet) passes; wgmma and wgmma_wg2 left out where the
# GPU has no sm_90a; and where the probe failed also auto -> builtin,cudnn and lists without wgmma.
# Duplicates are dropped.
settings() {
  local -n into=$1
  shift
  into="$*"
  uses_wgmma "$@" || return 0
  probe_wgmma
  [ "$wgmma" = ok ] && return 0
  local s kept=" "
  for s in "$@"; do
    case $s in
      wgmma | wgmma_wg2) continue ;;
      auto) [ "$wgmma" = failed ] && s=builtin,wgmma,cudnn ;;
    esac
    [ "$wgmma" = failed ] && s=$(tr , '\n' <<<"$s" | grep -vx wgmma | paste -sd,)
    [[ $kept == *" $s "* ]] || kept+="$s "
  done
  kept=${kept# }
  into=${kept% }
  echo "gpu_check: without the warpgroup kernels (probe: $wgmma): '$*' runs as '$into'"
}
"$B/run" nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
for part in "${parts[@]}"; do
  case $part in
    unit)
      # The cases that may run the warpgroup kernels (wgmma, auto) in a step of their own, after the probe.
      wg_cases="*wgmma*,*attention auto*,*auto falls back*"
      step unit "$B/run" mpigpt_tests "--source-file=*/cuda/*_test.cpp" "--source-file-exclude=*_np2_test.cpp" \
        "--test-case-exclude=$wg_cases" --no-version=true
      probe_wgmma
      if [ "$wgmma" != failed ]; then
        step unit_wgmma "$B/run" mpigpt_tests "--source-file=*/cuda/*_test.cpp" \
          "--source-file-exclude=*_np2_test.cpp" "--test-case=$wg_cases" --no-version=true
      else
        echo "gpu_check: unit_wgmma not run (the warpgroup probe failed)"
      fi
      step unit_np2 "$B/run" mpirun -np 2 --oversubscribe --bind-to none mpigpt_tests \
        "--source-file=*/cuda/*_np2_test.cpp" --no-version=true ;;
    regression)
      [ -n "${DATA:-}" ] || { echo "gpu_check: regression needs DATA=PREFIX" >&2; status=1; continue; }
      common=(--binary "$B/bin/mpigpt" --mpirun "mpirun --oversubscribe --bind-to none" --data "$DATA"
              --require-gpu --with-one-rank)
      shared="--engine.backend cuda --engine.comm mpi --engine.allow_device_sharing true"
      step regression_fp32 "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" --out "$OUT/reg_fp32" \
        --layouts "^(dp2|tp2|pp2|cp2|moe-ep2)$" --families gpt2,llama,gpt2-moe,llama-moe --layout-args "$shared"
      step regression_bf16 "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" --out "$OUT/reg_bf16" \
        --layouts "^(moe-ep2|tp2-dp2-distopt)$" --families gpt2,gpt2-moe,llama-moe --steps 50 --skip-reference \
        --tol 2e-2 --layout-args "$shared --training.precision bf16"
      # One head of 64 channels, so that the attention runs on the kernels of head dims 64 and 128
      # (as regression/regression.cmake's tiny_hd64.ini), with each attention setting.
      sed 's/^num_heads = 4$/num_heads = 1/' "$SRC/regression/tiny.ini" >"$OUT/tiny_hd64.ini"
      # Resuming is exact (emulated/cli/cuda_bf16_resume_np2 on the GPU): two ranks sharing the GPU,
      # bf16, the distributed optimizer, stopped at iteration 2 and resumed, must give iterations 3
      # and 4 the uninterrupted run's gradient norms and losses. GEMM autotuning off: it may choose
      # other algorithms in the second run, and with them other roundings.
      resume_check() {
        local dir=$OUT/resume run
        rm -rf "$dir" && mkdir -p "$dir" || return 1
        run=(timeout -k 10 "${STEP_TIMEOUT:-0}" "$B/run" mpirun -np 2 --oversubscribe --bind-to none mpigpt train
             --model.num_layers 2 --model.hidden 64 --model.num_heads 1 --model.seq_len 64
             --training.micro_batch 2 --training.global_batch 8
             --training.log_interval 1 --training.lr 1e-3 --training.warmup_iters 2 --training.train_iters 4
             --training.precision bf16 --engine.distributed_optimizer true --data.path "$DATA" $shared
             --engine.gemm_autotune false)
        "${run[@]}" --checkpoint.save "$dir/a" --checkpoint.save_interval 2 --training.metrics_file "$dir/a.jsonl" &&
          "${run[@]}" --checkpoint.load "$dir/a/iter_0000002" --training.metrics_file "$dir/b.jsonl" || return 1
        local pat='"grad_norm":[^,]*,"iter":[34],"loss":[^,]*'
        grep -o "$pat" "$dir/a.jsonl" >"$dir/a.txt"; grep -o "$pat" "$dir/b.jsonl" >"$dir/b.txt"
        cat "$dir/a.txt" "$dir/b.txt"
        [ "$(wc -l <"$dir/a.txt")" = 2 ] && diff "$dir/a.txt" "$dir/b.txt" && echo "resume: iterations 3 and 4 equal"
      }
      step resume_bf16 resume_check
      settings backends builtin wgmma auto
      for backend in $backends; do
        step "regression_bf16_hd64_$backend" "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" \
          --out "$OUT/reg_bf16_hd64_$backend" --config "$OUT/tiny_hd64.ini" --layouts "^$" --families gpt2 \
          --steps 50 --skip-reference --tol 2e-2 \
          --layout-args "$shared --training.precision bf16 --engine.attention_backend $backend"
      done ;;
    bench)
      # ARGS (bench_gpu.sh's options for every run) with its attention setting as it may run (settings).
      read -ra bench_args <<<"${ARGS:-}"
      for i in "${!bench_args[@]}"; do
        case ${bench_args[i]} in
          --engine.attention_backend=*) settings a "${bench_args[i]#*=}"
                                        bench_args[i]=--engine.attention_backend=$a ;;
          --engine.attention_backend) [ $((i + 1)) -lt ${#bench_args[@]} ] || continue
                                      settings a "${bench_args[i + 1]}"
                                      bench_args[i + 1]=$a ;;
        esac
      done
      step bench env MPIGPT="$B/run mpigpt" LOG="$OUT/bench_runs.log" ARGS="${bench_args[*]}" \
        "$SRC/scripts/bench_gpu.sh" "$SRC"/inputs/{gpt2_124m,gpt2_350m,gpt2_1p3b,llama_1b}_gpu.ini ;;
    attention)
      saved_timeout=${STEP_TIMEOUT-}
      STEP_TIMEOUT=${STEP_TIMEOUT:-150}
      # The attention variants alone (`mpigpt bench-attention`: the kernels at the model's shape)
      # and in a training step, each setting in a process of its own: a kernel that faults takes
      # the CUDA context with it, so one that does costs its own figures, not the others'. auto
      # runs every candidate on its first call's data, checks each against the builtin kernels and
      # logs their times and its choice, so its log has builtin (mma.sync), wgmma (sm_90a) and
      # cuDNN's fused attention side by side as well. KERNELS and TRAIN name the settings run
      # (defaults above). Micro-batch 64 (Llama 1B: 32), no recompute; each run's summary lines
      # are in its log.
      setting() {  # name: the environment and option of an attention setting
        case $1 in
          *_wg2) echo "MPIGPT_ATTENTION_WG_TWO_BUFFERS=1 --engine.attention_backend ${1%_wg2}" ;;
          *) echo "MPIGPT_ATTENTION_WG_TWO_BUFFERS= --engine.attention_backend $1" ;;
        esac
      }
      # shellcheck disable=SC2086 # (the settings are words)
      settings kernel_settings ${KERNELS:-builtin cudnn wgmma wgmma_wg2 auto}
      # shellcheck disable=SC2086
      settings train_settings ${TRAIN:-builtin cudnn wgmma auto}
      for model in ${MODELS:-gpt2_124m gpt2_1p3b llama_1b}; do
        mb=64
        [ "$model" = llama_1b ] && mb=32
        kargs=(mpigpt bench-attention --config "$SRC/inputs/${model}_gpu.ini" --training.micro_batch $mb
               --bench-steps 20 --bench-warmup 5)
        for name in $kernel_settings; do
          read -r env_var opt value <<<"$(setting "$name")"
          step "kernels_${model}_$name" env "$env_var" "$B/run" "${kargs[@]}" "$opt" "$value"
        done
        args=(mpigpt bench --config "$SRC/inputs/${model}_gpu.ini" --training.micro_batch $mb
              --training.global_batch $mb --engine.recompute none --bench-steps 10 --bench-warmup 3)
        for ((round = 1; round <= ${ROUNDS:-1}; ++round)); do
          for name in $train_settings; do
            read -r env_var opt value <<<"$(setting "$name")"
            step "attention_${model}_${name}_$round" env "$env_var" "$B/run" "${args[@]}" "$opt" "$value"
          done
        done
      done
      # The lines that matter, last, so that they are at the end of the output: each kernel run's
      # times and each training run's MFU, with auto's choices.
      for log in "$OUT"/kernels_*.log "$OUT"/attention_*.log; do
        [ -e "$log" ] || continue
        echo "== $(basename "$log" .log)"
        grep -E "bench-attention: (forward|attention)|bench: (achieved|.*attention)|rror" "$log" |
          cut -c1-300 | head -12
      done
      STEP_TIMEOUT=$saved_timeout ;;
    *) echo "gpu_check: unknown part $part (unit, regression, bench, attention)" >&2; exit 2 ;;
  esac
done
exit $status
