// Tests of Config::validate: valid layouts pass, and every rule's message names the fields, the
// value and the fix.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "io/config/config.h"
#include "lib/core/error.h"

namespace {

using mpigpt::Config;
using mpigpt::Error;
using mpigpt::parse_config_args;

#define CHECK_FAILS(expr, text) \
  CHECK_THROWS_WITH_AS(expr, doctest::Contains(std::string(text).c_str()), Error)

Config parsed(const std::vector<std::string>& args) { return parse_config_args(args).config; }

}  // namespace

TEST_CASE("config: valid layouts pass") {
  Config c = parsed({});
  CHECK_NOTHROW(c.validate(1));
  CHECK(c.dp(1) == 1);
  Config big = parsed({"--tp=2", "--pp=2", "--vpp=2", "--num_layers=8", "--micro_batch=1", "--global_batch=8",
                       "--sequence_parallel", "--distributed_optimizer", "--overlap_grad_reduce",
                       "--overlap_param_gather", "--order=pp-dp-ep-cp-tp"});
  CHECK_NOTHROW(big.validate(8));
  CHECK(big.dp(8) == 2);
  CHECK_NOTHROW(parsed({"--distributed_optimizer"}).validate(1));                 // dp = 1 is allowed
  CHECK_NOTHROW(parsed({"--sequence_parallel"}).validate(1));                     // a no-op at tp = 1
  CHECK_NOTHROW(parsed({"--precision=bf16", "--backend=cuda"}).validate(1));
  CHECK_NOTHROW(parsed({"--family=llama", "--max_position=16"}).validate(1));     // RoPE needs no table
  CHECK_NOTHROW(parsed({"--num_experts=4", "--ep=2", "--tp=2", "--sequence_parallel", "--global_batch=8"}).validate(4));
  CHECK_NOTHROW(parsed({"--num_experts=4", "--ep=2", "--expert_tp=2", "--tp=2", "--sequence_parallel", "--global_batch=8"})
                    .validate(4));
  CHECK_NOTHROW(parsed({"--num_experts=4", "--ep=4", "--cp=2", "--seq_len=8", "--global_batch=8"}).validate(4));
}

TEST_CASE("config: validate names the field, the value and the fix: ranges, enumerations, the order") {
  SUBCASE("sizes must be positive") {
    for (const char* name : {"parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep",
                             "parallel.expert_tp", "model.num_layers", "model.hidden", "model.num_heads",
                             "model.num_kv_heads", "model.ffn_hidden", "model.seq_len", "model.max_position",
                             "model.vocab_multiple", "training.micro_batch", "training.global_batch",
                             "training.log_interval", "engine.bucket_size"}) {
      CAPTURE(name);
      Config c = parsed({});
      mpigpt::config_set(c, name, "-1");
      CHECK_FAILS(c.validate(1), fmt::format("{} = -1 must be at least 1", name));
    }
    for (const char* name : {"training.train_iters", "training.warmup_iters", "training.decay_iters", "training.eval_interval",
                             "checkpoint.save_interval", "checkpoint.keep_last", "engine.threads", "model.vocab_size"}) {
      CAPTURE(name);
      CHECK_FAILS(parsed({fmt::format("--{}=-1", name)}).validate(1), fmt::format("{} = -1 must be at least 0", name));
    }
    CHECK_FAILS(parsed({"--eval_iters=0"}).validate(1), "training.eval_iters = 0 must be at least 1");
    CHECK_NOTHROW(parsed({"--eval_iters=0", "--eval_interval=0"}).validate(1));
  }
  SUBCASE("real-valued ranges") {
    CHECK_FAILS(parsed({"--lr=-1", "--min_lr=-2"}).validate(1), "training.lr = -1 must not be negative");
    CHECK_FAILS(parsed({"--min_lr=-1"}).validate(1), "training.min_lr = -1 must not be negative");
    CHECK_FAILS(parsed({"--lr=1e-4", "--min_lr=1e-3"}).validate(1), "training.min_lr = 0.001 exceeds training.lr = 0.0001");
    CHECK_FAILS(parsed({"--beta1=1"}).validate(1), "training.beta1 = 1 must lie in [0, 1)");
    CHECK_FAILS(parsed({"--beta2=-0.1"}).validate(1), "training.beta2 = -0.1 must lie in [0, 1)");
    CHECK_FAILS(parsed({"--eps=0"}).validate(1), "training.eps = 0 must be positive");
    CHECK_FAILS(parsed({"--clip_grad=-1"}).validate(1), "training.clip_grad = -1 must not be negative");
    CHECK_FAILS(parsed({"--weight_decay=-0.5"}).validate(1), "training.weight_decay = -0.5 must not be negative");
    CHECK_FAILS(parsed({"--valid_fraction=1"}).validate(1), "data.valid_fraction = 1 must lie in [0, 1)");
    CHECK_FAILS(parsed({"--valid_fraction=-0.1"}).validate(1), "data.valid_fraction = -0.1 must lie in [0, 1)");
    CHECK_NOTHROW(parsed({"--valid_fraction=0", "--lr=0", "--clip_grad=0", "--beta1=0"}).validate(1));
    CHECK_FAILS(parsed({"--peak_tflops=-1"}).validate(1), "training.peak_tflops = -1 must not be negative");
    CHECK_FAILS(parsed({"--comm_timeout=-1"}).validate(1), "engine.comm_timeout = -1 must be a number of seconds");
    CHECK_FAILS(parsed({"--comm_timeout=inf"}), "engine.comm_timeout = 'inf' is not a finite number");
    CHECK_NOTHROW(parsed({"--comm_timeout=0"}).validate(1));  // waits never time out
    CHECK(parsed({"--comm_timeout=0.5"}).engine.comm_timeout == 0.5);
    CHECK_FAILS(parsed({"--norm_eps=0"}).validate(1), "model.norm_eps = 0 must be positive");
    CHECK_FAILS(parsed({"--rope_theta=0"}).validate(1), "model.rope_theta = 0 must be positive");
    CHECK_FAILS(parsed({"--init_std=-0.02"}).validate(1), "model.init_std = -0.02 must not be negative");
  }
  SUBCASE("enumerations") {
    for (const char* name : {"model.family", "training.lr_schedule", "engine.recompute", "engine.grad_accum_dtype",
                             "training.precision", "engine.backend", "engine.comm", "engine.attention_backend",
                             "data.tokenizer"}) {
      CAPTURE(name);
      CHECK_FAILS(parsed({fmt::format("--{}=bogus", name)}).validate(1), fmt::format("{} = 'bogus' is not one of", name));
    }
    CHECK_FAILS(parsed({"--recompute=partial"}).validate(1), "engine.recompute = 'partial' is not one of none | selective | full");
    CHECK_FAILS(parsed({"--no_decay=norms,bias"}).validate(1), "training.no_decay = 'norms,bias': 'bias' is not a parameter kind");
    CHECK_NOTHROW(parsed({"--no_decay", ""}).validate(1));
  }
  SUBCASE("the order string is a permutation of the five axes") {
    CHECK_FAILS(parsed({"--order=tp-cp-dp-pp"}).validate(1), "parallel.order = 'tp-cp-dp-pp' lacks the axis ep");
    CHECK_FAILS(parsed({"--order=tp-cp-ep-dp-pp-tp"}).validate(1), "parallel.order = 'tp-cp-ep-dp-pp-tp' names the axis tp twice");
    CHECK_FAILS(parsed({"--order=tp-xp-ep-dp-pp"}).validate(1), "parallel.order = 'tp-xp-ep-dp-pp': 'xp' is not an axis");
    CHECK_FAILS(parsed({"--order=tp,cp,ep,dp,pp"}).validate(1), "'tp,cp,ep,dp,pp' is not an axis");
    CHECK_FAILS(parsed({"--order=tp-cp-ep-dp-pp-"}).validate(1), "'' is not an axis");
  }
}

TEST_CASE("config: validate names the field, the value and the fix: grid, engine, batches, model") {
  SUBCASE("the world size and the rank grids") {
    Config c = parsed({"--tp=2", "--pp=2"});
    CHECK_FAILS(c.validate(6), "parallel.tp * parallel.pp * parallel.cp = 2*2*1 = 4 does not divide the world size 6; "
                               "launch a multiple of 4 ranks or change the sizes");
    CHECK_FAILS(c.dp(6), "does not divide the world size 6");
    CHECK_FAILS(c.validate(0), "the world size 0 must be at least 1");
    CHECK_FAILS(c.dp(0), "the world size 0 must be at least 1");
    CHECK_FAILS(parsed({"--cp=0"}).dp(1), "parallel.tp, parallel.pp and parallel.cp must be at least 1 (they are 1, 1, 0)");
    CHECK_FAILS(parsed({"--ep=3", "--micro_batch=1"}).validate(4),
                "parallel.expert_tp * parallel.ep = 1*3 = 3 does not divide the 4 ranks of a pipeline stage");
    CHECK_FAILS(parsed({"--ep=2", "--expert_tp=2", "--pp=2", "--num_layers=4", "--micro_batch=1"}).validate(4),
                "parallel.expert_tp * parallel.ep = 2*2 = 4 does not divide the 2 ranks");
  }
  SUBCASE("engine combinations") {
    CHECK_FAILS(parsed({"--overlap_param_gather", "--overlap_grad_reduce"}).validate(1),
                "engine.overlap_param_gather = true needs engine.distributed_optimizer = true and "
                "engine.overlap_grad_reduce = true (they are false and true)");
    CHECK_FAILS(parsed({"--overlap_param_gather", "--distributed_optimizer"}).validate(1),
                "(they are true and false)");
    CHECK_FAILS(parsed({"--precision=bf16", "--grad_accum_dtype=bf16"}).validate(1),
                "training.precision = bf16 needs engine.grad_accum_dtype = fp32 (it is bf16)");
    CHECK_NOTHROW(parsed({"--grad_accum_dtype=bf16"}).validate(1));
    // engine.comm: NCCL moves device memory only; auto and mpi suit either backend.
    CHECK_FAILS(parsed({"--comm=nccl"}).validate(1),
                "engine.comm = nccl needs engine.backend = cuda (it is cpu)");
    CHECK_NOTHROW(parsed({"--comm=nccl", "--backend=cuda"}).validate(1));
    for (const char* backend : {"cpu", "cuda"})
      for (const char* comm : {"auto", "mpi"}) CHECK_NOTHROW(parsed({"--backend", backend, "--comm", comm}).validate(1));
    // engine.attention_backend = cudnn: bf16 causal attention on the GPU; builtin and unset suit any run.
    auto cudnn_with = [&](std::vector<std::string> more) {
      std::vector<std::string> args = {"--attention_backend=cudnn", "--backend=cuda", "--precision=bf16"};
      args.insert(args.end(), more.begin(), more.end());
      return parsed(args);
    };
    CHECK_NOTHROW(cudnn_with({}).validate(1));
    CHECK_FAILS(cudnn_with({"--backend=cpu"}).validate(1),
                "engine.attention_backend = cudnn, but engine.backend = cpu: cuDNN runs on the GPU; set "
                "engine.attention_backend = builtin, or leave it unset");
    CHECK_FAILS(cudnn_with({"--precision=fp32"}).validate(1),
                "engine.attention_backend = cudnn, but training.precision = fp32: cuDNN's fused attention takes bf16");
    CHECK_FAILS(cudnn_with({"--cp=2", "--micro_batch=1", "--global_batch=1"}).validate(2),
                "engine.attention_backend = cudnn, but parallel.cp = 2: context parallelism runs the blockwise");
    CHECK_FAILS(cudnn_with({"--sequence_packing"}).validate(1),
                "engine.attention_backend = cudnn, but engine.sequence_packing = true");
    for (const char* removed : {"auto", "wgmma", "builtin,cudnn", "flash"})
      CHECK_FAILS(parsed({"--backend=cuda", "--attention_backend", removed}).validate(1),
                  fmt::format("engine.attention_backend = '{}' is not one of cudnn | builtin", removed));
    CHECK_FAILS(parsed({"--nccl_init=shared"}).validate(1), "init_rank | split");
    CHECK(parsed({"--nccl_init=split"}).engine.nccl_init == "split");
    for (const char* backend : {"cpu", "cuda"})
      for (const char* ab : {"", "builtin"})
        CHECK_NOTHROW(parsed({"--backend", backend, "--attention_backend", ab}).validate(1));
  }
  SUBCASE("batch sizes") {
    CHECK_FAILS(parsed({"--micro_batch=4", "--global_batch=4"}).validate(2),
                "training.global_batch = 4 is not divisible by training.micro_batch * dp = 4*2 = 8");
    CHECK_FAILS(parsed({"--micro_batch=3", "--global_batch=4"}).validate(1), "training.micro_batch * dp = 3*1 = 3");
  }
  SUBCASE("the model divides over the grid") {
    CHECK_FAILS(parsed({"--pp=3", "--micro_batch=1", "--global_batch=1"}).validate(3),
                "model.num_layers = 4 is not divisible by parallel.pp * parallel.vpp = 3*1 = 3");
    CHECK_FAILS(parsed({"--pp=2", "--vpp=4"}).validate(2), "model.num_layers = 4 is not divisible by parallel.pp * parallel.vpp = 2*4 = 8");
    CHECK_FAILS(parsed({"--tp=3"}).validate(3), "model.num_heads = 4 is not divisible by parallel.tp = 3");
    CHECK_FAILS(parsed({"--tp=4", "--num_heads=8", "--num_kv_heads=2"}).validate(4),
                "model.num_kv_heads = 2 is not divisible by parallel.tp = 4");
    CHECK_FAILS(parsed({"--tp=2", "--ffn_hidden=1001"}).validate(2),
                "model.ffn_hidden = 1001 is not divisible by parallel.tp = 2");
    CHECK_FAILS(parsed({"--num_heads=4", "--num_kv_heads=3"}).validate(1),
                "model.num_heads = 4 is not divisible by model.num_kv_heads = 3");
    CHECK_FAILS(parsed({"--hidden=250"}).validate(1), "model.hidden = 250 is not divisible by model.num_heads = 4");
    CHECK_FAILS(parsed({"--family=llama", "--hidden=36"}).validate(1), "model.hidden / model.num_heads = 36/4 = 9 is odd");
    CHECK_NOTHROW(parsed({"--hidden=36"}).validate(1));  // gpt2 has no RoPE
    CHECK_FAILS(parsed({"--cp=2", "--seq_len=6"}).validate(2), "model.seq_len = 6 is not divisible by 2 * parallel.cp = 4");
    CHECK_NOTHROW(parsed({"--seq_len=6"}).validate(1));
    CHECK_FAILS(parsed({"--max_position=128"}).validate(1), "model.max_position = 128 is smaller than model.seq_len = 256");
    CHECK_FAILS(parsed({"--qkv_bias"}).validate(1), "model.qkv_bias = true is for model.family = llama");
    CHECK_NOTHROW(parsed({"--family=llama", "--qkv_bias"}).validate(1));
  }
  SUBCASE("sequence parallelism") {
    CHECK_FAILS(parsed({"--ep=2", "--tp=2", "--global_batch=8"}).validate(4),
                "parallel.ep = 2 with parallel.tp = 2 needs parallel.sequence_parallel = true");
    CHECK_FAILS(parsed({"--tp=2", "--sequence_parallel", "--seq_len=255"}).validate(2),
                "model.seq_len = 255 is not divisible by parallel.tp = 2; parallel.sequence_parallel");
    CHECK_NOTHROW(parsed({"--tp=2", "--seq_len=255"}).validate(2));
    CHECK_FAILS(parsed({"--tp=4", "--cp=2", "--sequence_parallel", "--seq_len=12"}).validate(8),
                "model.seq_len / parallel.cp = 12/2 = 6 is not divisible by parallel.tp = 4");
  }
  SUBCASE("interleaved pipeline") {
    CHECK_FAILS(parsed({"--vpp=2"}).validate(1), "parallel.vpp = 2 needs parallel.pp > 1");
    CHECK_FAILS(parsed({"--pp=2", "--vpp=2", "--micro_batch=1", "--global_batch=3"}).validate(2),
                "(training.micro_batch * dp) = 3/(1*1) = 3, to be divisible by parallel.pp = 2");
    CHECK_NOTHROW(parsed({"--pp=2", "--vpp=2", "--micro_batch=1", "--global_batch=4"}).validate(2));
  }
  SUBCASE("checkpoints") {
    CHECK_FAILS(parsed({"--save_interval=10"}).validate(1), "checkpoint.save_interval = 10 but checkpoint.save is empty");
    CHECK_NOTHROW(parsed({"--save_interval=10", "--save=ckpt"}).validate(1));
  }
}

TEST_CASE("config: validate names the field, the value and the fix: mixture of experts") {
  CHECK_NOTHROW(parsed({"--num_experts=4", "--moe_top_k=2"}).validate(1));
  CHECK_NOTHROW(parsed({"--num_experts=4", "--tp=2", "--sequence_parallel", "--moe_layers=every:2"}).validate(2));
  CHECK_NOTHROW(parsed({"--num_experts=4", "--moe_layers=0,3", "--moe_capacity_factor=1.25",
                        "--moe_drop_policy=position", "--moe_router=sigmoid"}).validate(1));
  CHECK_NOTHROW(parsed({"--moe_top_k=9"}).validate(1));  // MoE options are inert without experts
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_top_k=5"}).validate(1),
              "model.moe_top_k = 5 exceeds model.num_experts = 4; each token is routed to K distinct experts: set "
              "moe_top_k <= 4");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_top_k=0"}).validate(1), "model.moe_top_k = 0 must be at least 1");
  CHECK_FAILS(parsed({"--num_experts=-1"}).validate(1), "model.num_experts = -1 must be at least 0");
  CHECK_FAILS(parsed({"--num_experts=3", "--ep=2", "--global_batch=8"}).validate(2),
              "model.num_experts = 3 is not divisible by parallel.ep = 2");
  CHECK_FAILS(parsed({"--ep=2", "--global_batch=8"}).validate(2),
              "parallel.ep = 2 and parallel.expert_tp = 1 split the experts of a mixture-of-experts model, but "
              "model.num_experts = 0 (dense)");
  CHECK_FAILS(parsed({"--num_experts=4", "--expert_tp=2", "--ffn_hidden=6", "--moe_ffn_hidden=5",
                      "--global_batch=8"}).validate(2),
              "model.moe_ffn_hidden = 5 is not divisible by parallel.expert_tp = 2");
  // EP with CP where the expert grid cannot re-divide a pipeline stage: ep 4 over cp 2 x dp 2
  // works with pp last, but with pp between cp and the rest an expert group would span stages.
  CHECK_NOTHROW(parsed({"--num_experts=4", "--ep=4", "--cp=2", "--pp=2", "--num_layers=2", "--seq_len=8",
                        "--global_batch=8"}).validate(8));
  CHECK_FAILS(parsed({"--num_experts=4", "--ep=2", "--cp=2", "--pp=2", "--num_layers=2", "--seq_len=8",
                      "--order=cp-pp-tp-ep-dp", "--global_batch=8"}).validate(8),
              "parallel.order = cp-pp-tp-ep-dp cannot hold expert parallelism here: the axes before pp (cp) span 2 "
              "ranks of the dense grid (tp 1, cp 2, dp 2) but 1 of the expert grid (expert_tp 1, ep 2, expert-dp 2)");
  CHECK_FAILS(parsed({"--num_experts=4", "--ep=4", "--cp=2", "--global_batch=8", "--seq_len=8"}).validate(2),
              "parallel.expert_tp * parallel.ep = 1*4 = 4 does not divide the 2 ranks of a pipeline stage "
              "(world size 2 / parallel.pp 1 = tp 1 x cp 2 x dp 1)");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_capacity_factor=-1"}).validate(1),
              "model.moe_capacity_factor = -1 must not be negative; set 0 for dropless routing");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_capacity_factor=0", "--moe_drop_policy=position"}).validate(1),
              "model.moe_drop_policy = position is set but model.moe_capacity_factor = 0 means dropless routing");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_drop_policy=random"}).validate(1),
              "model.moe_drop_policy = 'random' is not one of probs | position");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_router=topk"}).validate(1),
              "model.moe_router = 'topk' is not one of softmax | sigmoid");
  CHECK_FAILS(parsed({"--moe_dispatcher=flex"}).validate(1),
              "parallel.moe_dispatcher = 'flex' is not one of alltoall | allgather");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_aux_loss_coeff=-0.1"}).validate(1),
              "model.moe_aux_loss_coeff = -0.1 must not be negative");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_z_loss_coeff=-1"}).validate(1),
              "model.moe_z_loss_coeff = -1 must not be negative");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_layers=1,4"}).validate(1),
              "model.moe_layers = '1,4' names layer 4 but model.num_layers = 4 (layers 0..3)");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_layers=every:x"}).validate(1),
              "model.moe_layers = 'every:x': 'x' is not a non-negative integer; write all, every:N");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_layers=1;2"}).validate(1),
              "model.moe_layers = '1;2': '1;2' is not a non-negative integer");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_layers=every:0"}).validate(1),
              "model.moe_layers = 'every:0': N must be at least 1");
  CHECK_FAILS(parsed({"--num_experts=4", "--moe_layers=every:8"}).validate(1),
              "model.moe_layers = 'every:8' selects no layer of model.num_layers = 4");
  CHECK_FAILS(parsed({"--num_experts=4", "--tp=2"}).validate(2),
              "model.num_experts = 4 with parallel.tp = 2 needs parallel.sequence_parallel = true");
  const std::vector<bool> every2 = mpigpt::parse_moe_layers("every:2", 4), list = mpigpt::parse_moe_layers("0,2", 4);
  CHECK(every2 == std::vector<bool>{false, true, false, true});
  CHECK(list == std::vector<bool>{true, false, true, false});
  CHECK(mpigpt::parse_moe_layers("all", 3) == std::vector<bool>{true, true, true});
}

TEST_CASE("config: validate names the field, the value and the fix: LoRA") {
  CHECK_NOTHROW(parsed({"--lora.rank=8"}).validate(1));
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--lora.targets=qkv, fc2", "--tp=2", "--sequence_parallel", "--pp=2",
                        "--global_batch=8"}).validate(4));
  CHECK_NOTHROW(parsed({"--lora.dropout=0.1"}).validate(1));  // inert while lora.rank = 0
  CHECK_FAILS(parsed({"--lora.rank=-1"}).validate(1), "lora.rank = -1 must be at least 0");
  CHECK_FAILS(parsed({"--lora.rank=8", "--lora.targets=qkv,up_proj"}).validate(1),
              "lora.targets = 'qkv,up_proj': 'up_proj' is not a linear layer LoRA adapts; write a comma list of qkv "
              "(or q, k, v), proj, fc1 (or gate, up), fc2");
  // An adapter per projection: any of q, k, v in place of qkv, gate and up in place of fc1 (SwiGLU).
  CHECK(mpigpt::lora_target_set(" v,q ,fc2") == std::set<std::string>{"q", "v", "fc2"});
  CHECK(parsed({"--lora.rank=8", "--lora.rslora", "true"}).lora.rslora);
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--family=llama", "--lora.targets=q,v,gate,up"}).validate(1));
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--lora.targets=k,fc1"}).validate(1));
  CHECK_FAILS(parsed({"--lora.rank=8", "--lora.targets=qkv,v"}).validate(1),
              "lora.targets = 'qkv,v' names both qkv (one adapter shared by q, k and v) and v (an adapter of its "
              "own); write one or the other");
  CHECK_FAILS(parsed({"--lora.rank=8", "--family=llama", "--lora.targets=fc1,up"}).validate(1), "names both fc1 (one adapter shared by gate and up) and up");
  CHECK_FAILS(parsed({"--lora.rank=8", "--lora.targets=q,gate"}).validate(1),
              "lora.targets = 'q,gate': 'gate' is a projection of SwiGLU's MLP; a model.family = gpt2 MLP has one up "
              "projection: adapt it as fc1");
  CHECK_FAILS(parsed({"--lora.rank=8", "--lora.targets", ""}).validate(1), "lora.targets = '' names no layer");
  CHECK_FAILS(parsed({"--lora.rank=8", "--lora.alpha=0"}).validate(1), "lora.alpha = 0 must be positive");
  CHECK_FAILS(parsed({"--lora.rank=8", "--lora.dropout=0.05"}).validate(1),
              "lora.dropout = 0.05 is not supported: the adapters train without dropout; set lora.dropout = 0");
  CHECK_FAILS(parsed({"--lora.rank=300"}).validate(1),
              "lora.rank = 300 is larger than the smallest adapted layer's 256 features (model.hidden = 256, "
              "model.ffn_hidden = 1024): a low-rank update needs rank <= 256");
  CHECK_NOTHROW(parsed({"--lora.rank=40", "--hidden=64", "--ffn_hidden=32", "--lora.targets=qkv,proj"}).validate(1));
  CHECK_FAILS(parsed({"--lora.rank=40", "--hidden=64", "--ffn_hidden=32"}).validate(1), "needs rank <= 32");
  // Adapter checkpoints: save, and load on a base (init_from_*); still one base at most.
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--save=ck"}).validate(1));
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--load=ck"}).validate(1));
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--init_from_checkpoint=ck"}).validate(1));
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--load=ck", "--init_from_checkpoint=base"}).validate(1));
  CHECK_FAILS(parsed({"--load=ck", "--init_from_checkpoint=base"}).validate(1), "give at most one place to start from");
  CHECK_FAILS(parsed({"--lora.rank=8", "--init_from_hf=a", "--init_from_checkpoint=b"}).validate(1),
              "give at most one place to start from");
  CHECK_NOTHROW(parsed({"--lora.rank=8", "--num_experts=4", "--moe_ffn_hidden=16", "--ep=2", "--expert_tp=2",
                         "--global_batch=16"}).validate(4));
  CHECK_FAILS(parsed({"--lora.rank=8", "--num_experts=4", "--moe_ffn_hidden=6"}).validate(1),
              "lora.rank = 8 is larger than the smallest adapted layer's 6 features");
}
