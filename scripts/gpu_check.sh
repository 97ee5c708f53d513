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
#   MODELS=...    attention and bench: the inputs/*_gpu.ini models (default: attention gpt2_124m
#                 gpt2_1p3b llama_1b; bench those and gpt2_350m), e.g. to split the bench over calls
#   ROUNDS=N      attention: rounds of the alternated variants (default 1)
#   KERNELS=...   attention: the settings timed alone (default "builtin cudnn wgmma wgmma_wg2 auto"; a
#                 name ending in _wg2 runs the warpgroup backward's two-buffer variant at head dim 64)
#   TRAIN=...     attention: the settings of the training steps (default "builtin cudnn wgmma auto"; a
#                 setting is any engine.attention_backend value, e.g. builtin,cudnn: auto among those)
#   STEP_TIMEOUT=S  seconds each command may run before it is killed and reported failed (exit 124):
#                 a kernel that hangs costs one step, not the session (default none; attention 150)
#   PROBE_TIMEOUT=S seconds for each command of a probe (below; default 60)
#
# The optional attention kernels, Hopper's warpgroup ones (wgmma) and cuDNN's fused attention, are
# each probed once, before the first step that would run them (unit, a setting naming them or
# auto, ARGS of the bench): their unit test (wgmma: the primitives against exact products; cuDNN:
# its attention against the CPU's), then the kernels once at the 124M and 1.3B shapes. A kernel
# that faults takes its process's CUDA context with it, and one that hangs its step's timeout, in
# every step that runs it: the probe pays that once. A probe that fails or hangs is reported
# failed, and the rest runs without those kernels: their unit cases are not run, settings naming
# them alone are left out, lists (and auto, builtin,wgmma,cudnn) lose them, and the auto unit
# cases are not run. On a GPU whose compute capability is not 9.0 there are no warpgroup kernels
# to probe, and where cuDNN does not load none of its: only the settings naming them alone, an
# error there, are left out.
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
# The probes (above): probed[k] is empty until k's has run, then ok, failed, or absent (wgmma on a
# GPU that runs no sm_90a code, cuDNN where its library does not load: auto and lists skip the
# kernels there by themselves, and a setting naming them alone is an error).
declare -A probed=([wgmma]= [cudnn]=)
probe_commands() {  # kernels: the probe's commands, each within PROBE_TIMEOUT
  local t=${PROBE_TIMEOUT:-60} test=cuda_mma model log rc
  [ "$1" = cudnn ] && test=cudnn_sdpa
  # (auto's cases would run the other kernels too)
  timeout -k 10 "$t" "$B/run" mpigpt_tests "--source-file=*/cuda/${test}_test.cpp" "--test-case-exclude=*auto*" \
    --no-version=true || return
  for model in gpt2_124m gpt2_1p3b; do
    log=$OUT/${1}_probe_$model.log
    timeout -k 10 "$t" "$B/run" mpigpt bench-attention --config "$SRC/inputs/${model}_gpu.ini" \
      --training.micro_batch 2 --bench-steps 1 --bench-warmup 1 --engine.attention_backend "$1" >"$log" 2>&1
    rc=$?
    cat "$log"
    # No cuDNN to load (or a build without it): absent, not failed; its unit cases pass without it.
    # (step runs this function in the script's shell, so the state it sets stays.)
    if [ $rc -ne 0 ] && [ "$1" = cudnn ] && grep -qE "cannot load the cuDNN library|built without cuDNN" "$log"; then
      probed[cudnn]=absent
      return 0
    fi
    [ $rc -eq 0 ] || return $rc
  done
}
probe() {  # kernels (wgmma or cudnn): probes them unless done
  [ -z "${probed[$1]}" ] || return 0
  local cc
  if [ "$1" = wgmma ]; then
    cc=$("$B/run" nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
    if [[ $cc =~ ^[0-9]+\.[0-9]+$ ]] && [ "$cc" != 9.0 ]; then  # (not known: probe)
      probed[wgmma]=absent
      echo "gpu_check: the GPU's compute capability is $cc, not 9.0: no warpgroup (sm_90a) kernels to probe"
      return 0
    fi
  fi
  if ! step "${1}_probe" probe_commands "$1"; then
    probed[$1]=failed
  elif [ "${probed[$1]}" = absent ]; then
    echo "gpu_check: $1 is absent here (${1}_probe.log says why): settings naming it alone are left out"
  else
    probed[$1]=ok
  fi
}
# as_probed VAR setting...: VAR = the attention settings as they may run. For each optional kernel
# a setting runs (by name, in a list, or through auto), its probe (run here if not yet): where it
# passed, nothing changes; where it failed, settings naming it alone are left out and it leaves
# the lists (auto as builtin,wgmma,cudnn); where it is absent, only the settings naming it alone
# are left out. Duplicates are dropped.
as_probed() {
  local -n into=$1
  shift
  local k s kept list=("$@")
  for k in wgmma cudnn; do
    kept=" "
    for s in "${list[@]}"; do
      case ,$s, in
        *,auto,* | *,$k,* | *,${k}_wg2,*)
          probe "$k"
          case ${probed[$k]}:$s in
            ok:*) ;;
            *:"$k" | *:"${k}_wg2") continue ;;
            failed:*) [ "$s" = auto ] && s=builtin,wgmma,cudnn
                      s=$(tr , '\n' <<<"$s" | grep -vx "$k" | paste -sd,) ;;
          esac ;;
      esac
      [[ $kept == *" $s "* ]] || kept+="$s "
    done
    read -ra list <<<"$kept"
  done
  into="${list[*]}"
  [ "$into" = "$*" ] ||
    echo "gpu_check: '$*' runs as '$into' (probes: wgmma ${probed[wgmma]:-not run}, cudnn ${probed[cudnn]:-not run})"
}
"$B/run" nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
for part in "${parts[@]}"; do
  case $part in
    unit)
      # The cases of the optional kernels (wgmma, cuDNN, auto over them) in a step of their own, after
      # the probes, without those of kernels whose probe failed (and then without auto's).
      optional="*wgmma*,cudnn attention*,*attention auto*"
      step unit "$B/run" mpigpt_tests "--source-file=*/cuda/*_test.cpp" "--source-file-exclude=*_np2_test.cpp" \
        "--test-case-exclude=$optional" --no-version=true
      probe wgmma
      probe cudnn
      cases=() filters=()
      [ "${probed[wgmma]}" = failed ] || cases+=("*wgmma*")
      [ "${probed[cudnn]}" = failed ] || cases+=("cudnn attention*")
      if [ ${#cases[@]} = 2 ]; then
        cases+=("*attention auto*")
      else
        filters+=("--test-case-exclude=*auto*")
      fi
      filters+=("--test-case=$(IFS=,; echo "${cases[*]}")")
      if [ ${#cases[@]} -gt 0 ]; then
        step unit_optional "$B/run" mpigpt_tests "--source-file=*/cuda/*_test.cpp" \
          "--source-file-exclude=*_np2_test.cpp" "${filters[@]}" --no-version=true
      else
        echo "gpu_check: unit_optional not run (both probes failed)"
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
      as_probed backends builtin wgmma auto
      for backend in $backends; do
        step "regression_bf16_hd64_$backend" "$B/run" python3 "$SRC/regression/run.py" "${common[@]}" \
          --out "$OUT/reg_bf16_hd64_$backend" --config "$OUT/tiny_hd64.ini" --layouts "^$" --families gpt2 \
          --steps 50 --skip-reference --tol 2e-2 \
          --layout-args "$shared --training.precision bf16 --engine.attention_backend $backend"
      done ;;
    bench)
      # ARGS (bench_gpu.sh's options for every run) with its attention setting as it may run (as_probed).
      read -ra bench_args <<<"${ARGS:-}"
      for i in "${!bench_args[@]}"; do
        case ${bench_args[i]} in
          --engine.attention_backend=*) as_probed a "${bench_args[i]#*=}"
                                        bench_args[i]=--engine.attention_backend=$a ;;
          --engine.attention_backend) [ $((i + 1)) -lt ${#bench_args[@]} ] || continue
                                      as_probed a "${bench_args[i + 1]}"
                                      bench_args[i + 1]=$a ;;
        esac
      done
      bench_configs=()
      for model in ${MODELS:-gpt2_124m gpt2_350m gpt2_1p3b llama_1b}; do
        bench_configs+=("$SRC/inputs/${model}_gpu.ini")
      done
      step bench env MPIGPT="$B/run mpigpt" LOG="$OUT/bench_runs.log" ARGS="${bench_args[*]}" \
        "$SRC/scripts/bench_gpu.sh" "${bench_configs[@]}" ;;
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
      as_probed kernel_settings ${KERNELS:-builtin cudnn wgmma wgmma_wg2 auto}
      # shellcheck disable=SC2086
      as_probed train_settings ${TRAIN:-builtin cudnn wgmma auto}
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
