# mpigpt: the two commands of the quick start (`make run`, `make test`) and their helpers.
# Everything goes through CMake in build/; `make deps` installs the Debian (and npm test-oracle)
# packages the build and the tests need, skipping what is already there.

BUILD      ?= build
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
NATIVE     ?= ON
NPM_DIR    := .deps/npm

DEB_PACKAGES := build-essential cmake ninja-build pkg-config openmpi-bin libopenmpi-dev openssh-client \
  libhdf5-openmpi-dev hdf5-tools libboost-program-options-dev libfmt-dev doctest-dev \
  libopenblas-openmp-dev nlohmann-json3-dev libicu-dev fortunes nodejs python3-matplotlib python3-numpy procps \
  iproute2 xz-utils slurmctld slurmd slurm-client munge

# Root may start mpirun only when it says so; tests also need --oversubscribe on 2 cores. The ranks
# talk over shared memory only, no TCP port opened (as cmake/tests.cmake's MPIGPT_MPIRUN).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
MPIRUN := mpirun --allow-run-as-root --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader \
  --mca oob_tcp_if_include lo

FORTUNES := $(filter-out %.dat %.u8,$(wildcard /usr/share/games/fortunes/*))
# Debian's python3 is the one `make deps` gives matplotlib (another may come first in PATH).
PYTHON3  := $(firstword $(wildcard /usr/bin/python3) python3)
RUN_NP   ?= 1

.PHONY: all build deps run test test-sanitize bench bench-parallel bench-moe bench-checkpoint bench-plan bench-attention bench-gpu bundle clean

all: build

deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "make deps: all Debian packages present"; fi
	@# npm: Debian's nodejs lacks it (its own package), NodeSource's nodejs carries it.
	@command -v npm >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends npm; }
	@if [ ! -f $(NPM_DIR)/node_modules/gpt-3-encoder/package.json ]; then \
	  echo "make deps: installing the npm test oracle gpt-3-encoder"; \
	  mkdir -p $(NPM_DIR) && npm install --silent --no-audit --no-fund --prefix $(NPM_DIR) gpt-3-encoder@1.1.4; \
	fi

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DMPIGPT_NATIVE=$(NATIVE) $(CMAKE_ARGS)

build: $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# The default demo: byte-level fortunes corpus, tiny GPT-2, a few hundred steps on the CPU, then
# the plot of its loss curves (build/tiny_loss.png).
$(BUILD)/data/fortunes.idx: | build
	$(BUILD)/mpigpt prepare-data --output $(BUILD)/data/fortunes --tokenizer byte \
	  --format delimited --delimiter % $(FORTUNES)

run: deps build $(BUILD)/data/fortunes.idx
	$(MPIRUN) -np $(RUN_NP) -x OMP_NUM_THREADS=$$(( $(JOBS) / $(RUN_NP) > 0 ? $(JOBS) / $(RUN_NP) : 1 )) \
	  $(BUILD)/mpigpt train --config inputs/tiny.ini --data.path $(BUILD)/data/fortunes \
	  --training.metrics_file $(BUILD)/tiny_metrics.jsonl
	$(PYTHON3) scripts/plot_metrics.py $(BUILD)/tiny_metrics.jsonl --label "inputs/tiny.ini" --output $(BUILD)/tiny_loss.png

test: deps build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

# The whole suite again, built with AddressSanitizer and UndefinedBehaviorSanitizer (the C++ code,
# the CUDA kernels through the host emulator): any finding fails its test. Not part of `make
# test`; run it after changing memory handling or a kernel's indexing.
SANITIZE_BUILD ?= build-sanitize
test-sanitize: deps
	cmake -S . -B $(SANITIZE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DMPIGPT_SANITIZE=ON -DMPIGPT_CUDA=OFF $(CMAKE_ARGS)
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	cd $(SANITIZE_BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1800

bench: deps build
	OMP_NUM_THREADS=2 $(BUILD)/mpigpt bench --config inputs/gpt2_124m_bench.ini

# Memory, communication volume and bubble of one model under several layouts (8 ranks at most).
PAR_LAYOUTS := "1" "2" "2 --engine.distributed_optimizer true" "4" "4 --engine.distributed_optimizer true" \
  "2 --parallel.tp 2" "2 --parallel.tp 2 --parallel.sequence_parallel true" "2 --parallel.pp 2" \
  "4 --parallel.pp 4" "4 --parallel.pp 4 --parallel.vpp 2" \
  "8 --parallel.tp 2 --parallel.pp 2 --engine.distributed_optimizer true --engine.overlap_grad_reduce true --engine.overlap_param_gather true" \
  "2 --parallel.cp 2" "2 --parallel.cp 2 --parallel.cp_comm_type all_gather" "4 --parallel.cp 4" \
  "4 --parallel.cp 4 --parallel.cp_comm_type all_gather" "4 --parallel.cp 2 --parallel.tp 2 --parallel.sequence_parallel true"
bench-parallel: deps build
	@for l in $(PAR_LAYOUTS); do set -- $$l; np=$$1; shift; echo "== np $$np $$*"; \
	  $(MPIRUN) -np $$np -x OMP_NUM_THREADS=1 $(BUILD)/mpigpt bench --config inputs/gpt2_parallel_bench.ini \
	    --bench-steps 2 --bench-warmup 1 "$$@" | grep -E "bench: (per rank|communication|pipeline)"; done

# The planner's time model against this machine: the CPU profile, then the step time of the layouts
# lib/plan/time_model_test.cpp predicts (scripts/bench_plan_cpu.sh; ROUNDS=5 for steadier medians).
bench-plan: deps build
	MPIGPT=$(BUILD)/mpigpt MPIRUN="$(MPIRUN)" OUT=$(BUILD)/bench_plan scripts/bench_plan_cpu.sh

# Mixture of experts: the communication volume per group of expert-parallel layouts (synthetic
# tokens), then the expert load imbalance (max/mean top-k assignments per expert) of the `make run`
# model with 8 experts on the default data, trained with and without the load-balancing loss.
MOE_LAYOUTS := "1" "2 --parallel.ep 2" "2 --parallel.ep 2 --parallel.moe_dispatcher allgather" "4 --parallel.ep 4" \
  "4 --parallel.ep 4 --parallel.moe_dispatcher allgather" "4 --parallel.tp 2 --parallel.sequence_parallel true --parallel.ep 2" \
  "4 --parallel.tp 2 --parallel.sequence_parallel true --parallel.ep 2 --parallel.expert_tp 2" \
  "4 --parallel.tp 2 --parallel.sequence_parallel true --parallel.ep 2 --parallel.expert_tp 2 --parallel.moe_dispatcher allgather" \
  "8 --parallel.ep 4"
MOE_LOAD_STEPS ?= 200
bench-moe: deps build $(BUILD)/data/fortunes.idx
	@for l in $(MOE_LAYOUTS); do set -- $$l; np=$$1; shift; echo "== np $$np $$*"; \
	  $(MPIRUN) -np $$np -x OMP_NUM_THREADS=1 $(BUILD)/mpigpt bench --config inputs/gpt2_moe_bench.ini \
	    --bench-steps 2 --bench-warmup 1 "$$@" | grep -E "bench: (per rank|communication)"; done
	@for aux in 0 0.01; do echo "== load: make run model, 8 experts top-2 in every layer, moe_aux_loss_coeff $$aux"; \
	  OMP_NUM_THREADS=$(JOBS) $(BUILD)/mpigpt train --config inputs/tiny.ini --data.path $(BUILD)/data/fortunes \
	    --model.num_experts 8 --model.moe_top_k 2 --model.moe_ffn_hidden 256 --model.moe_aux_loss_coeff $$aux \
	    --training.train_iters $(MOE_LOAD_STEPS) --training.log_interval 50 --training.eval_interval 0 | grep -E "^iter"; done

# Checkpoint save/load bandwidth of GPT-2 124M with Adam state (distributed optimizer) at 1-8
# ranks, next to the disk's raw sequential write bandwidth (dd with fsync) in the same place.
CKPT_DIR ?= $(BUILD)/bench_checkpoint
bench-checkpoint: deps build
	@mkdir -p $(CKPT_DIR) && echo "== dd: 1 GiB sequential write with fsync into $(CKPT_DIR)" && \
	  dd if=/dev/zero of=$(CKPT_DIR)/dd.tmp bs=1M count=1024 conv=fsync 2>&1 | tail -1 && rm -f $(CKPT_DIR)/dd.tmp
	@for np in 1 2 4 8; do \
	  $(MPIRUN) -np $$np -x OMP_NUM_THREADS=1 $(BUILD)/mpigpt bench-checkpoint --config inputs/gpt2_124m_bench.ini \
	    --engine.distributed_optimizer true --training.micro_batch 1 --training.global_batch 8 --checkpoint.save $(CKPT_DIR)/np$$np | grep "bench-checkpoint:"; done

# One GPU: GPT-2 124M / 350M / 1.3B-class and a Llama-style 1B in bf16, the largest micro-batch that
# fits with and without recompute, tokens/s, TFLOP/s, MFU, peak memory, and a per-op breakdown.
# The causal attention's kernels alone at the GPU models' shapes (one GPU; ARGS adds options, e.g.
# "--engine.attention_backend auto", which also logs every candidate's time).
bench-attention: deps build
	for c in gpt2_124m gpt2_1p3b llama_1b; do \
	  $(BUILD)/mpigpt bench-attention --config inputs/$${c}_gpu.ini $(ARGS) | grep "bench-attention:" || exit 1; done

bench-gpu: deps build
	MPIGPT=$(BUILD)/mpigpt LOG=$(BUILD)/bench_gpu.log scripts/bench_gpu.sh

# A relocatable folder for GPU nodes that have the CUDA driver and toolkit but none of our Debian
# packages (bundle/README.txt, docs/user-guide.md): its own build, without -march=native, with the
# CUDA backend when nvcc is present; then scripts/bundle.sh collects binaries, libraries and Open MPI.
BUNDLE_BUILD ?= build-bundle
BUNDLE_DIR   ?= bundle
BUNDLE_ARGS  ?=
bundle: deps
	cmake -S . -B $(BUNDLE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DMPIGPT_NATIVE=OFF \
	  -DMPIGPT_CUDA=$$( { [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; } && echo ON || echo OFF ) \
	  $(CMAKE_ARGS)
	cmake --build $(BUNDLE_BUILD) -j $(JOBS) --target mpigpt mpigpt_tests
	scripts/bundle.sh $(BUNDLE_BUILD) $(BUNDLE_DIR) $(BUNDLE_ARGS)

clean:
	rm -rf $(BUILD)
