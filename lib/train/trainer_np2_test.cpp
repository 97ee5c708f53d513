// Two ranks: data-parallel training (gradients and losses summed over the world) reproduces the
// single-rank run of the same global batch, step for step, validation losses included.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "io/data/loss_mask.h"
#include "io/data/prepare_data.h"
#include "io/io_testing.h"
#include "lib/train/train_testing.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

Config small_config(const std::string& family) {
  Config cfg = testing::small_train_config(family, 2, 12);
  cfg.training.warmup_iters = 2;
  cfg.training.eval_interval = 6;  // eval_iters global batches: the same samples in every layout
  cfg.training.eval_iters = 2;
  return cfg;
}

}  // namespace

TEST_CASE("dp=2 reproduces the single-rank loss curve and validation losses (both families)") {
  for (const char* family : {"gpt2", "llama"}) {
    CAPTURE(family);
    Config cfg = small_config(family);
    TrainOptions opts;
    opts.synthetic_data = true;
    opts.quiet = true;
    cfg.validate(1);
    const auto ops = make_cpu_ops();
    const TrainResult single = train(cfg, Mesh(MPI_COMM_SELF, MeshSizes{}), *ops, opts);
    cfg.validate(2);
    const TrainResult dp2 = train(cfg, Mesh(MPI_COMM_WORLD, MeshSizes{}), *ops, opts);
    REQUIRE(single.losses.size() == dp2.losses.size());
    // Random tokens cannot be learned; the curves are compared, so they must not be trivial.
    CHECK(single.losses.front() != single.losses.back());
    CHECK(single.grad_norms.front() > 0.01);
    for (size_t i = 0; i < single.losses.size(); ++i) {
      CAPTURE(i);
      CHECK(dp2.losses[i] == doctest::Approx(single.losses[i]).epsilon(1e-5));
      CHECK(dp2.grad_norms[i] == doctest::Approx(single.grad_norms[i]).epsilon(1e-4));
    }
    REQUIRE(single.val_losses.size() == 2);
    REQUIRE(dp2.val_losses.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
      CHECK(dp2.val_losses[i].first == single.val_losses[i].first);
      CHECK(dp2.val_losses[i].second == doctest::Approx(single.val_losses[i].second).epsilon(1e-6));
    }
  }
}

TEST_CASE("dp=2 reproduces the single-rank curve on instruction data: the loss counts the responses only") {
  // Prompt/response records (byte tokens), each rank preparing its own copy. The loss is summed over
  // the response tokens of the global batch and divided by their count, the same in both layouts.
  testing::TempDir tmp;
  std::string records;
  for (int i = 0; i < 60; ++i)
    records += fmt::format("{{\"q\": \"question {} of {}?\", \"a\": \"the answer is {}.\"}}\n", i, i * 7 % 13, i * i);
  testing::write_file(tmp / "sft.jsonl", records);
  const std::string prefix = tmp / "sft";
  REQUIRE(run_prepare_data({"--output", prefix, "--format", "jsonl", "--prompt-key", "q", "--response-key", "a",
                            tmp / "sft.jsonl"}, 0) == 0);
  Config cfg = small_config("gpt2");
  cfg.model.vocab_size = 257;
  cfg.data.path = prefix;
  cfg.data.valid_fraction = 0.1;
  TrainOptions opts;
  opts.quiet = true;
  const auto ops = make_cpu_ops();
  cfg.validate(1);
  const TrainResult single = train(cfg, Mesh(MPI_COMM_SELF, MeshSizes{}), *ops, opts);
  cfg.validate(2);
  const TrainResult dp2 = train(cfg, Mesh(MPI_COMM_WORLD, MeshSizes{}), *ops, opts);
  REQUIRE(single.losses.size() == dp2.losses.size());
  for (size_t i = 0; i < single.losses.size(); ++i) {
    CAPTURE(i);
    CHECK(dp2.losses[i] == doctest::Approx(single.losses[i]).epsilon(1e-5));
    CHECK(dp2.grad_norms[i] == doctest::Approx(single.grad_norms[i]).epsilon(1e-4));
  }
  REQUIRE(dp2.val_losses.size() == single.val_losses.size());
  for (size_t i = 0; i < single.val_losses.size(); ++i)
    CHECK(dp2.val_losses[i].second == doctest::Approx(single.val_losses[i].second).epsilon(1e-6));
  // Without the mask every token counts: another curve from the first step on.
  std::filesystem::remove(prefix + ".mask");
  cfg.validate(1);
  const TrainResult unmasked = train(cfg, Mesh(MPI_COMM_SELF, MeshSizes{}), *ops, opts);
  CHECK(unmasked.losses.front() != doctest::Approx(single.losses.front()).epsilon(1e-3));
}

TEST_CASE("a loss mask changes the loss by a known amount: the mean over the counted targets") {
  // Documents of even length (odd text + EOD): a token's parity in its document is its parity in
  // the stream whatever the document order, so any T (even) consecutive targets hold T/2 of each
  // parity. Counting the even tokens, then the odd ones, splits every batch's targets in halves:
  // the unmasked loss (over all of them) is the mean of the two masked losses of the same step.
  // A loss divided by all the batch's targets instead of the counted ones would be half that.
  testing::TempDir tmp;
  std::string records;
  for (int i = 0; i < 80; ++i) {
    std::string text = fmt::format("note {} says {} and {}", i, i * 7 % 13, i * i);
    if (text.size() % 2 == 0) text += '.';
    records += fmt::format("{{\"text\": \"{}\"}}\n", text);
  }
  testing::write_file(tmp / "d.jsonl", records);
  const std::string prefix = tmp / "d";
  REQUIRE(run_prepare_data({"--output", prefix, "--format", "jsonl", tmp / "d.jsonl"}, 0) == 0);
  const int64_t tokens = int64_t(std::filesystem::file_size(prefix + ".bin") / 2);  // uint16 byte tokens
  auto write_mask = [&](int parity) {
    std::string m(kMaskHeaderBytes + size_t(tokens), '\0');
    std::memcpy(m.data(), kMaskMagic, 8);
    std::memcpy(m.data() + 8, &kMaskVersion, 8);
    std::memcpy(m.data() + 16, &tokens, 8);
    for (int64_t t = 0; t < tokens; ++t) m[kMaskHeaderBytes + size_t(t)] = char(t % 2 == parity);
    testing::write_file(prefix + ".mask", m);
  };
  Config cfg = small_config("llama");
  cfg.model.vocab_size = 257;
  cfg.data.path = prefix;
  cfg.training.train_iters = 1;
  cfg.validate(1);
  REQUIRE(cfg.model.seq_len % 2 == 0);
  TrainOptions opts;
  opts.quiet = true;
  const auto ops = make_cpu_ops();
  auto first_loss = [&] { return train(cfg, Mesh(MPI_COMM_SELF, MeshSizes{}), *ops, opts).losses.at(0); };
  const double all = first_loss();
  write_mask(0);
  const double even = first_loss();
  write_mask(1);
  const double odd = first_loss();
  CHECK(even != doctest::Approx(odd).epsilon(1e-3));  // the halves differ: the mask is applied
  CHECK(all == doctest::Approx((even + odd) / 2).epsilon(1e-6));
}
