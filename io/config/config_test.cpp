// Tests of the configuration layer: files and overrides, bare keys, flags, typed errors with
// file:line, "did you mean" hints, --help, the to_ini round trip and family defaults (the
// validate() rules: config_validate_test.cpp).
#include "io/config/config.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "lib/core/error.h"

namespace {

using mpigpt::Config;
using mpigpt::ConfigOption;
using mpigpt::Error;
using mpigpt::parse_config_args;
namespace fs = std::filesystem;

#define CHECK_FAILS(expr, text) \
  CHECK_THROWS_WITH_AS(expr, doctest::Contains(std::string(text).c_str()), Error)

// A scratch INI file named like the user's (messages show the path), removed at scope end.
struct TempIni {
  fs::path path;
  TempIni(const std::string& name, const std::string& text)
      : path(fs::temp_directory_path() / fmt::format("mpigpt_config_test_{}_{}", getpid(), name)) {
    std::ofstream(path) << text;
  }
  ~TempIni() { fs::remove(path); }
  std::string str() const { return path.string(); }
};

Config parsed(const std::vector<std::string>& args) { return parse_config_args(args).config; }

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("config: files in order, then command-line overrides") {
  TempIni a("a.ini",
            "# first file\n[training]\nlr = 1e-3\nseed = 7\n\n[model]\nnum_layers = 6  # inline comment\n"
            "[parallel]\ntp = 2\norder = \"tp-cp-ep-dp-pp\"\n");
  TempIni b("b.ini", "[training]\nlr = 2e-3\n");

  Config one = parsed({"--config", a.str()});
  CHECK(one.training.lr == 1e-3);
  CHECK(one.training.seed == 7);
  CHECK(one.model.num_layers == 6);
  CHECK(one.parallel.tp == 2);
  CHECK(one.sources == std::vector<std::string>{a.str()});

  Config two = parsed({"--config", a.str(), "--config=" + b.str()});
  CHECK(two.training.lr == 2e-3);  // the later file wins
  CHECK(two.model.num_layers == 6);
  CHECK(two.sources == std::vector<std::string>{a.str(), b.str()});

  // The command line beats every file, wherever --config stands, in both spellings.
  Config cli = parsed({"--training.lr", "5e-4", "--config", a.str(), "--model.num_layers=8", "--config", b.str()});
  CHECK(cli.training.lr == 5e-4);
  CHECK(cli.model.num_layers == 8);
  CHECK(cli.training.seed == 7);
  // Of two overrides the last wins; a negative number is a value, not an option.
  CHECK(parsed({"--training.lr", "1", "--training.lr", "-2"}).training.lr == -2);
  CHECK(parsed({}).training.lr == Config{}.training.lr);
}

TEST_CASE("config: bare keys on the command line and in a file without section") {
  Config c = parsed({"--lr", "1e-3", "--tp=2", "--num_layers", "3", "--family", "llama"});
  CHECK(c.training.lr == 1e-3);
  CHECK(c.parallel.tp == 2);
  CHECK(c.model.num_layers == 3);
  CHECK(c.model.family == "llama");
  CHECK(parsed({"--comm", "mpi"}).engine.comm == "mpi");  // the switch away from NCCL, as the errors suggest it
  // Megatron-LM's dashed spellings name the same keys.
  Config m = parsed({"--save", "ck", "--save-interval", "5", "--checkpoint.keep-last", "2", "--micro-batch=2"});
  CHECK(m.checkpoint.save == "ck");
  CHECK(m.checkpoint.save_interval == 5);
  CHECK(m.checkpoint.keep_last == 2);
  CHECK(m.training.micro_batch == 2);
  TempIni f("bare.ini", "seed = 99\n[model]\nhidden = 512\n");
  Config d = parsed({"--config", f.str()});
  CHECK(d.training.seed == 99);
  CHECK(d.model.hidden == 512);

  // Today no key is in two sections, so ambiguity is checked on a made-up table.
  std::vector<ConfigOption> two{{"a", "x", "int", "", {}}, {"b", "x", "int", "", {}}, {"b", "y", "int", "", {}}};
  CHECK(mpigpt::resolve_option_name("y", two, "") == "b.y");
  CHECK(mpigpt::resolve_option_name("a.x", two, "") == "a.x");
  CHECK_FAILS(mpigpt::resolve_option_name("x", two, "command line", "--"),
              "command line: option '--x' is ambiguous: it may mean '--a.x' or '--b.x'; write the full section.key name");
}

TEST_CASE("config: boolean spellings") {
  for (std::string w : {"true", "1", "yes", "on", "TRUE", "On"}) {
    CAPTURE(w);
    CHECK(parsed({"--parallel.sequence_parallel", w}).parallel.sequence_parallel);
    CHECK(parsed({"--parallel.sequence_parallel=" + w}).parallel.sequence_parallel);
    TempIni f("bool.ini", "[parallel]\nsequence_parallel = " + w + "\n");
    CHECK(parsed({"--config", f.str()}).parallel.sequence_parallel);
  }
  for (std::string w : {"false", "0", "no", "off"}) {
    CAPTURE(w);
    CHECK_FALSE(parsed({"--sequence_parallel=true", "--parallel.sequence_parallel", w}).parallel.sequence_parallel);
    CHECK_FALSE(parsed({"--sequence_parallel=on", "--sequence_parallel=" + w}).parallel.sequence_parallel);
  }
  // Alone it means true, and a following word that is no boolean stays positional.
  auto p = parse_config_args({"a.txt", "--engine.distributed_optimizer", "b.txt", "--overlap_grad_reduce"});
  CHECK(p.config.engine.distributed_optimizer);
  CHECK(p.config.engine.overlap_grad_reduce);
  CHECK(p.positional == std::vector<std::string>{"a.txt", "b.txt"});
  CHECK(p.after_bool == std::map<size_t, std::string>{{1, "engine.distributed_optimizer"}});
  // A command that takes no words names the option whose value the word was meant to be.
  CHECK_FAILS(reject_positional(parse_config_args({"--sequence_parallel", "maybe"}), "usage"),
              "parallel.sequence_parallel = 'maybe' is not a boolean; write true/false, 1/0, yes/no or on/off");
  CHECK_FAILS(reject_positional(p, "see --help"), "unexpected argument 'a.txt'; options are written --section.key "
              "value (see --help)");
  Config q = parsed({"--sequence_parallel", "--lr", "1"});
  CHECK(q.parallel.sequence_parallel);
  CHECK(q.training.lr == 1);
  CHECK_FAILS(parsed({"--sequence_parallel=maybe"}),
              "parallel.sequence_parallel = 'maybe' is not a boolean; write true/false, 1/0, yes/no or on/off");
}

TEST_CASE("config: a value of the wrong type names file:line, option, value and fix") {
  TempIni f("tiny.ini", "[model]\nhidden = 64\nnum_layers = four\n");
  CHECK_FAILS(parsed({"--config", f.str()}), "tiny.ini:3: model.num_layers = 'four' is not an integer; write a whole number");
  CHECK_FAILS(parsed({"--training.lr", "abc"}), "command line: training.lr = 'abc' is not a finite number; write a decimal");
  CHECK_FAILS(parsed({"--model.hidden=3000000000"}), "model.hidden = '3000000000' is out of range for an int");
  CHECK_FAILS(parsed({"--training.seed=-1"}), "training.seed = '-1' is not a non-negative integer");
  CHECK_FAILS(parsed({"--model.hidden=4.5"}), "model.hidden = '4.5' is not an integer");
  CHECK_FAILS(parsed({"--model.num_layers"}), "command line: the required argument for option '--model.num_layers' is missing");
  TempIni g("broken.ini", "[model]\nhidden 64\n");
  CHECK_FAILS(parsed({"--config", g.str()}), "broken.ini:2: expected 'key = value' or '[section]', found 'hidden 64'");
  TempIni h("quote.ini", "[data]\npath = \"abc\n");
  CHECK_FAILS(parsed({"--config", h.str()}), "quote.ini:2: the quoted value \"abc has no closing '\"'");
  CHECK_FAILS(parsed({"--config", "/nonexistent/x.ini"}), "cannot read config file '/nonexistent/x.ini'");
  TempIni twice("twice.ini", "[training]\nlr = 1\nseed = 2\nlr = 3\n");
  CHECK_FAILS(parsed({"--config", twice.str()}), "twice.ini:4: training.lr is set twice in");
}

TEST_CASE("config: unknown keys suggest the closest option") {
  TempIni f("tiny.ini", "[training]\nlearning_rate = 1e-3\n");
  CHECK_FAILS(parsed({"--config", f.str()}),
              "tiny.ini:2: unknown option 'training.learning_rate'; did you mean 'training.lr'?");
  TempIni g("typo.ini", "[model]\nnum_layer = 2\n");
  CHECK_FAILS(parsed({"--config", g.str()}), "typo.ini:2: unknown option 'model.num_layer'; did you mean 'model.num_layers'?");
  TempIni s("section.ini", "[trainig]\nlr = 1\n");
  CHECK_FAILS(parsed({"--config", s.str()}), "section.ini:1: unknown section [trainig]; the sections are [parallel], [engine], [training]");

  CHECK_FAILS(parsed({"--training.num_layers", "3"}),
              "command line: unknown option '--training.num_layers'; did you mean '--model.num_layers'?");
  CHECK_FAILS(parsed({"--lr_shedule=cosine"}), "did you mean '--training.lr_schedule'?");
  CHECK_FAILS(parsed({"--tensor-model-parallel-size", "2"}), "did you mean '--parallel.tp'?");
  CHECK_FAILS(parsed({"--micro-batch-size=2"}), "did you mean '--training.micro_batch'?");
  CHECK_FAILS(parsed({"--sede", "1"}), "did you mean '--training.seed'?");
  CHECK_FAILS(parsed({"--layers", "1"}), "did you mean '--model.num_layers'?");
  CHECK_FAILS(parsed({"--distributed-backend=nccl"}), "did you mean '--engine.comm'?");
  CHECK_FAILS(parsed({"--distributed-timeout-minutes=10"}), "did you mean '--engine.comm_timeout'?");
  CHECK_FAILS(parsed({"--zzzzzzzz", "1"}), "unknown option '--zzzzzzzz'; run with --help to list the options");
  CHECK_FAILS(parsed({"-x"}), "command line: unknown option '-x'");
  CHECK_FAILS(parsed({"--data.path", "--lr", "1"}),
              "command line: option '--data.path' is missing its value (the next word '--lr' is an option)");
  CHECK(parsed({"--data.path=--odd"}).data.path == "--odd");
}

TEST_CASE("config: subcommand flags and positional words") {
  auto p = parse_config_args({"a.txt", "--dry-run", "--bench-steps", "5", "--lr", "1", "b.txt", "--bench-steps=7"},
                             {"dry-run!", "bench-steps"});
  CHECK(p.positional == std::vector<std::string>{"a.txt", "b.txt"});
  using Flags = std::vector<std::pair<std::string, std::string>>;
  CHECK(p.flags == Flags{{"dry-run", "true"}, {"bench-steps", "5"}, {"bench-steps", "7"}});
  CHECK(p.config.training.lr == 1);
  CHECK_FAILS(parse_config_args({"--dry-run"}), "unknown option '--dry-run'");
  // A flag named like a bare key is the flag; the option stays reachable by its full name.
  auto q = parse_config_args({"--seed", "3", "--training.seed", "4"}, {"seed"});
  CHECK(q.flags == Flags{{"seed", "3"}});
  CHECK(q.config.training.seed == 4);
}

TEST_CASE("config: --help lists every option in its section with default and description") {
  auto p = parse_config_args({"--lr", "1", "--help"}, {"dry-run!"});
  REQUIRE(p.help);
  const std::string& h = p.help_text;
  CHECK(h.find("--dry-run") != std::string::npos);
  CHECK(h.find("--config FILE") != std::string::npos);
  std::vector<size_t> headers;
  for (const auto& [section, description] : mpigpt::config_sections()) {
    const size_t at = h.find(fmt::format("[{}] {}:", section, description.substr(0, description.size() - 1)));
    CHECK_MESSAGE(at != std::string::npos, "no group for section ", section);
    headers.push_back(at);
  }
  CHECK(std::is_sorted(headers.begin(), headers.end()));
  headers.push_back(h.size());
  const auto& sections = mpigpt::config_sections();
  for (const ConfigOption& o : mpigpt::config_options()) {
    CAPTURE(o.name());
    const size_t s = std::find_if(sections.begin(), sections.end(), [&](auto& x) { return x.first == o.section; }) -
                     sections.begin();
    const size_t at = h.find("--" + o.name() + " ");
    REQUIRE(at != std::string::npos);
    CHECK(at > headers[s]);
    CHECK(at < headers[s + 1]);
    // Boost wraps long descriptions; compare their first words.
    CHECK(h.find(o.description.substr(0, 30), at) < headers[s + 1]);
  }
  CHECK(h.find("--training.lr NUM (=0.0003)") != std::string::npos);
  CHECK(h.find("--parallel.sequence_parallel BOOL (=false)") != std::string::npos);
  CHECK(h.find("--training.metrics_file STR (=\"\")") != std::string::npos);
}

TEST_CASE("config: the option table is exactly the fields and comments of config.h") {
  const std::string header = read_text(MPIGPT_TEST_DATA_DIR "/../io/config/config.h");
  std::istringstream in(header);
  const std::regex struct_re(R"(^struct (\w+) \{)"), member_re(R"(^\s+(\w+Config) (\w+);)"),
      field_re(R"(^\s+[\w:<>]+\s+(\w+)(\s*=\s*[^;]*)?;\s*//\s?(.*?)\s*$)");
  std::map<std::string, std::string> struct_comment;
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> fields;
  std::vector<std::pair<std::string, std::string>> members;  // (struct, section)
  std::string line, previous, current;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_search(line, m, struct_re)) {
      current = m[1];
      if (previous.rfind("// ", 0) == 0) struct_comment[current] = previous.substr(3);
    } else if (line == "};") {
      current.clear();
    } else if (current == "Config" && std::regex_search(line, m, member_re)) {
      members.emplace_back(m[1], m[2]);
    } else if (!current.empty() && std::regex_search(line, m, field_re)) {
      fields[current].emplace_back(m[1], m[3]);
    }
    previous = line;
  }
  std::vector<std::pair<std::string, std::string>> want_sections, want_options, got_options;
  for (const auto& [type, section] : members) {
    want_sections.emplace_back(section, struct_comment[type]);
    for (const auto& [key, comment] : fields[type]) want_options.emplace_back(section + "." + key, comment);
  }
  for (const ConfigOption& o : mpigpt::config_options()) got_options.emplace_back(o.name(), o.description);
  REQUIRE(want_sections.size() == 7);
  CHECK(want_options.size() > 60);
  CHECK(mpigpt::config_sections() == want_sections);
  CHECK(got_options == want_options);
}

TEST_CASE("config: to_ini reads back to the same configuration") {
  // Every option at a value unlike its default, strings with characters INI treats specially.
  Config c;
  const auto& options = mpigpt::config_options();
  for (size_t i = 0; i < options.size(); ++i) {
    const ConfigOption& o = options[i];
    std::string v;
    if (o.type == "bool") v = mpigpt::config_get(c, o.name()) == "true" ? "false" : "true";
    else if (o.type == "double") v = fmt::format("{}", 0.001 * double(i + 1) + 1e-9);
    else if (o.type == "string") v = fmt::format(" v{} # ; \"q\" \\ x= ", i);
    else v = std::to_string(1000 + i);
    mpigpt::config_set(c, o.name(), v);
  }
  const std::string ini = c.to_ini();
  TempIni f("round.ini", ini);
  Config back = parsed({"--config", f.str()});
  for (const ConfigOption& o : options) {
    CAPTURE(o.name());
    CHECK(mpigpt::config_get(back, o.name()) == mpigpt::config_get(c, o.name()));
    CHECK(mpigpt::config_get(back, o.name()) != mpigpt::config_get(Config{}, o.name()));
  }
  CHECK(back.to_ini() == ini);

  // A resolved llama configuration keeps its family defaults through the round trip.
  Config llama = parsed({"--family", "llama", "--hidden", "128"});
  TempIni g("llama.ini", llama.to_ini());
  Config again = parsed({"--config", g.str()});
  CHECK(again.to_ini() == llama.to_ini());
  CHECK_FALSE(again.model.tie_embeddings);
  CHECK(ini.find("[checkpoint]") != std::string::npos);
}

TEST_CASE("config: the full example lists every option at its default") {
  const std::string path = MPIGPT_TEST_DATA_DIR "/example_full.ini";
  Config c = parsed({"--config", path});
  for (const ConfigOption& o : mpigpt::config_options()) CHECK_MESSAGE(c.user_set.count(o.name()), o.name(), " is missing from ", path);
  CHECK(c.to_ini() == parsed({}).to_ini());
}

TEST_CASE("config: pipeline_layers is parallel.pipeline_layout, or the even split") {
  mpigpt::ParallelConfig p;
  p.pp = 2;
  p.vpp = 2;
  CHECK(mpigpt::pipeline_layers(p, 8) == std::vector<int>{2, 2, 2, 2});
  p.pipeline_layout = "0,3,4,1";
  CHECK(mpigpt::pipeline_layers(p, 8) == std::vector<int>{0, 3, 4, 1});
  CHECK_THROWS_WITH_AS(mpigpt::pipeline_layers(p, 9), doctest::Contains("adds up to 8 layers, but model.num_layers = 9"),
                       mpigpt::Error);
  p.pipeline_layout.clear();
  CHECK_THROWS_WITH_AS(mpigpt::pipeline_layers(p, 6), doctest::Contains("parallel.pipeline_layout"), mpigpt::Error);
}

TEST_CASE("config: resolve_defaults per family") {
  Config g = parsed({"--hidden", "256", "--num_heads", "8", "--seq_len", "512"});
  CHECK(g.model.num_kv_heads == 8);
  CHECK(g.model.ffn_hidden == 1024);
  CHECK(g.model.max_position == 512);
  CHECK(g.model.tie_embeddings);
  CHECK_FALSE(parsed({"--tie_embeddings=false"}).model.tie_embeddings);

  Config l = parsed({"--family", "llama", "--hidden", "256", "--num_kv_heads", "2"});
  CHECK(l.model.ffn_hidden == 704);  // 8*256/3 = 682 -> 704
  CHECK(l.model.num_kv_heads == 2);
  CHECK_FALSE(l.model.tie_embeddings);
  CHECK(parsed({"--family", "llama", "--hidden", "4096"}).model.ffn_hidden == 11008 - 64);  // 10922 -> 10944
  CHECK(parsed({"--family", "llama", "--hidden", "192"}).model.ffn_hidden == 512);  // 512 exactly
  CHECK(parsed({"--family", "llama", "--ffn_hidden", "100"}).model.ffn_hidden == 100);
  CHECK(parsed({"--family", "llama", "--tie_embeddings"}).model.tie_embeddings);
  CHECK(parsed({"--family", "llama"}).model.vocab_size == 0);

  Config plain;  // built in code: the family decides unless user_set names the option
  plain.model.family = "llama";
  plain.resolve_defaults();
  CHECK_FALSE(plain.model.tie_embeddings);
}
