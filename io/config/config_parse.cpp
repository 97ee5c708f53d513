// Configuration parsing: INI files given by --config and then command-line overrides
// (Boost.Program_options), bare keys, subcommand flags and the --help text, all driven by the
// option table of io/config/config.cpp.
#include <boost/program_options.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "io/config/config.h"
#include "lib/core/error.h"

namespace mpigpt {
namespace {

namespace po = boost::program_options;

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

bool is_bool_word(const std::string& s) {
  for (const char* w : {"true", "false", "1", "0", "yes", "no", "on", "off"})
    if (s == w) return true;
  return false;
}

// The value after '=': "quoted" (escapes \" \\ \n \t \r) or plain up to a comment that starts
// with whitespace + '#' or ';' (so that a value like a#b stays whole).
std::string ini_value(const std::string& rest, const std::string& where) {
  const std::string s = trim(rest);
  if (!s.empty() && s.front() == '"') {
    std::string out;
    size_t i = 1;
    for (; i < s.size() && s[i] != '"'; ++i) {
      if (s[i] == '\\' && i + 1 < s.size()) {
        const char e = s[++i];
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
      } else {
        out += s[i];
      }
    }
    if (i >= s.size()) fail("{}: the quoted value {} has no closing '\"'; close the quote", where, s);
    const std::string after = trim(s.substr(i + 1));
    if (!after.empty() && after[0] != '#' && after[0] != ';')
      fail("{}: text '{}' after the quoted value; put comments after '#'", where, after);
    return out;
  }
  for (size_t i = 1; i < s.size(); ++i)
    if ((s[i] == '#' || s[i] == ';') && (s[i - 1] == ' ' || s[i - 1] == '\t')) return trim(s.substr(0, i));
  return (!s.empty() && (s[0] == '#' || s[0] == ';')) ? "" : s;
}

// Boost's own config-file parser reports no line numbers, and every message about a file must
// name file:line; hence this small reader. Within one file a key may appear once. `path` names
// the text in messages.
void read_ini(std::istream& in, const std::string& path, Config& cfg) {
  std::vector<std::string> sections;
  for (const auto& s : config_sections()) sections.push_back(s.first);
  std::string section, line;
  std::map<std::string, int> first_line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    const std::string where = fmt::format("{}:{}", path, lineno);
    const std::string s = trim(line);
    if (s.empty() || s[0] == '#' || s[0] == ';') continue;
    if (s[0] == '[') {
      const size_t close = s.find(']');
      if (close == std::string::npos) fail("{}: section header '{}' lacks ']'; write [section]", where, s);
      section = trim(s.substr(1, close - 1));
      if (std::find(sections.begin(), sections.end(), section) == sections.end())
        fail("{}: unknown section [{}]; the sections are [{}]", where, section, fmt::join(sections, "], ["));
      continue;
    }
    const size_t eq = s.find('=');
    if (eq == std::string::npos)
      fail("{}: expected 'key = value' or '[section]', found '{}'; write key = value", where, s);
    const std::string key = trim(s.substr(0, eq));
    if (key.empty()) fail("{}: '{}' has no key before '='; write key = value", where, s);
    const std::string value = ini_value(s.substr(eq + 1), where);
    const std::string name = resolve_option_name(section.empty() ? key : section + "." + key,
                                                 config_options(), where);
    if (auto [it, fresh] = first_line.emplace(name, lineno); !fresh)
      fail("{}: {} is set twice in {} (first at line {}); keep one", where, name, path, it->second);
    config_set(cfg, name, value, where);
  }
  cfg.sources.push_back(path);
}

void read_ini(const std::string& path, Config& cfg) {
  if (std::filesystem::is_directory(path))
    fail("--config {} is a directory; give an INI file (e.g. inputs/tiny.ini)", path);
  std::ifstream in(path);
  if (!in)
    fail("cannot read config file '{}' ({}); check the path given to --config", path, std::strerror(errno));
  read_ini(in, path, cfg);
}

struct Flag {
  std::string name;
  bool takes_value;
};

std::vector<Flag> parse_flag_specs(const std::vector<std::string>& specs) {
  std::vector<Flag> flags;
  for (const std::string& spec : specs) {
    const bool bare = !spec.empty() && spec.back() == '!';
    flags.push_back(Flag{bare ? spec.substr(0, spec.size() - 1) : spec, !bare});
  }
  return flags;
}

std::string value_name(const ConfigOption& o) {
  if (o.type == "bool") return "BOOL";
  if (o.type == "double") return "NUM";
  if (o.type == "string") return "STR";
  return "INT";
}

// The options of --help: one group per section, each with default and description. For parsing,
// a BOOL option also takes no value (= true); the help leaves out Boost's noisy "[=BOOL(=true)]".
po::options_description describe(const std::vector<Flag>& flags, bool for_parsing) {
  po::options_description all("", 110, 56);
  po::options_description general("General options", 110, 56);
  general.add_options()("help,h", "this help")(
      "config", po::value<std::vector<std::string>>()->value_name("FILE"),
      "INI file ([section] headers, key = value); repeatable, later files override earlier ones");
  all.add(general);
  if (!flags.empty()) {
    po::options_description command("Command flags", 110, 56);
    for (const Flag& f : flags) {
      if (f.takes_value) command.add_options()(f.name.c_str(), po::value<std::string>()->value_name("VALUE"), "");
      else command.add_options()(f.name.c_str(), "");
    }
    all.add(command);
  }
  const Config defaults;
  for (const auto& [section, description] : config_sections()) {
    std::string caption = fmt::format("[{}] {}", section, description);
    if (caption.back() == '.') caption.pop_back();  // Boost appends ':'
    po::options_description group(caption, 110, 56);
    for (const ConfigOption& o : config_options()) {
      if (o.section != section) continue;
      std::string shown = config_get(defaults, o.name());
      if (shown.empty()) shown = "\"\"";
      auto* v = po::value<std::string>()->value_name(value_name(o))->default_value(shown, shown);
      if (o.type == "bool" && for_parsing) v->implicit_value("true");
      group.add_options()(o.name().c_str(), v, o.description.c_str());
    }
    all.add(group);
  }
  return all;
}

std::string help_text(const po::options_description& visible) {
  std::ostringstream os;
  os << "Options come from INI files given by --config (in order) and then from the command line,\n"
        "which overrides every file: --section.key VALUE or --section.key=VALUE. A bare key works\n"
        "when only one section has it (--lr 1e-3, --tp 2). BOOL accepts true/false, 1/0, yes/no,\n"
        "on/off; a BOOL option given alone means true. (=x) is the default.\n"
     << visible;
  return os.str();
}

bool is_flag(const std::vector<Flag>& flags, const std::string& name) {
  return std::any_of(flags.begin(), flags.end(), [&](const Flag& f) { return f.name == name; });
}

// Megatron-LM spells options with dashes (--save-interval); config keys use underscores.
// Subcommand flags keep their dashes (--dry-run), and only a spelling of a real option is
// rewritten: anything else keeps its words for the error.
std::vector<std::string> underscored(std::vector<std::string> args, const std::vector<ConfigOption>& options,
                                     const std::vector<Flag>& flags) {
  for (std::string& a : args) {
    if (a.size() <= 2 || a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    const std::string name = a.substr(2, end - 2);
    if (name.find('-') == std::string::npos) continue;
    std::string key = name;
    std::replace(key.begin(), key.end(), '-', '_');
    const bool known = std::any_of(options.begin(), options.end(),
                                   [&](const ConfigOption& o) { return o.name() == key || o.key == key; });
    if (known && !is_flag(flags, name))
      a.replace(2, end - 2, key);
  }
  return args;
}

bool is_bool_option(const std::vector<ConfigOption>& options, const std::string& name) {
  return std::any_of(options.begin(), options.end(),
                     [&](const ConfigOption& o) { return o.name() == name && o.type == "bool"; });
}

// Unambiguous bare keys as hidden aliases (alias_of: key -> full name); a flag of the same name
// wins over the alias. Ambiguous ones stay unregistered and are reported with their candidates.
po::options_description hidden_aliases(const std::vector<ConfigOption>& options, const std::vector<Flag>& flags,
                                       std::map<std::string, std::string>& alias_of) {
  std::map<std::string, std::vector<std::string>> by_key;  // bare key -> full names
  for (const ConfigOption& o : options) by_key[o.key].push_back(o.name());
  po::options_description hidden;
  hidden.add_options()("positional", po::value<std::vector<std::string>>());
  for (const auto& [key, names] : by_key) {
    if (names.size() != 1 || is_flag(flags, key) || key == "config" || key == "help" || key == "positional") continue;
    auto* v = po::value<std::string>();
    if (is_bool_option(options, names[0])) v->implicit_value("true");
    hidden.add_options()(key.c_str(), v);
    alias_of[key] = names[0];
  }
  return hidden;
}

}  // namespace

ParsedArgs parse_config_args(const std::vector<std::string>& raw_args, const std::vector<std::string>& extra_flags) {
  const std::vector<ConfigOption>& options = config_options();
  const std::vector<Flag> flags = parse_flag_specs(extra_flags);
  const std::vector<std::string> args = underscored(raw_args, options, flags);
  for (const Flag& f : flags)
    MPIGPT_CHECK(f.name.find('.') == std::string::npos && f.name != "config" && f.name != "help",
                 "subcommand flag '--{}' clashes with a config option", f.name);

  const po::options_description visible = describe(flags, true);
  std::map<std::string, std::string> alias_of;
  po::options_description everything;
  everything.add(visible).add(hidden_aliases(options, flags, alias_of));
  po::positional_options_description positional;
  positional.add("positional", -1);

  po::parsed_options parsed(&everything);
  try {
    parsed = po::command_line_parser(args)
                 .options(everything)
                 .positional(positional)
                 .style(po::command_line_style::unix_style ^ po::command_line_style::allow_guessing)
                 .allow_unregistered()
                 .run();
  } catch (const po::error& e) {
    fail("command line: {}; write --section.key VALUE or --section.key=VALUE (--help lists the options)", e.what());
  }

  ParsedArgs out;
  std::vector<std::string> files;
  struct Override {
    std::string name, value;
  };
  std::vector<Override> overrides;
  for (const po::option& o : parsed.options) {
    const std::string& token = o.original_tokens.empty() ? o.string_key : o.original_tokens[0];
    if (o.unregistered) {
      const bool long_form = token.rfind("--", 0) == 0;
      resolve_option_name(long_form ? o.string_key : token, options, "command line", long_form ? "--" : "");
      // resolve_option_name threw: the word is unknown or an ambiguous bare key.
      fail("command line: option '{}' is not accepted here; run with --help", token);
    }
    const std::string value = o.value.empty() ? "" : o.value[0];
    // Boost takes the next word as the value even when it is an option (`--data.path --lr 1`).
    if (o.original_tokens.size() == 2 && value.rfind("--", 0) == 0 && value.size() > 2)
      fail("command line: option '{}' is missing its value (the next word '{}' is an option); write "
           "{}=VALUE, which also takes a value starting with '--'", token, value, token);
    if (o.string_key == "positional") {
      out.positional.push_back(value);
    } else if (o.string_key == "help") {
      out.help = true;
    } else if (o.string_key == "config") {
      files.push_back(value);
    } else if (is_flag(flags, o.string_key)) {
      out.flags.emplace_back(o.string_key, o.value.empty() ? "true" : value);
    } else {
      const std::string name = alias_of.count(o.string_key) ? alias_of[o.string_key] : o.string_key;
      const bool is_bool = is_bool_option(options, name);
      std::string v = o.value.empty() ? "true" : value;
      // Boost gives a BOOL option the next word as its value (`--x false`); a word that is no
      // boolean (`--x input.txt`) means the option stood alone and the word is positional.
      if (is_bool && o.original_tokens.size() == 2 && !is_bool_word(lower(value))) {
        v = "true";
        out.after_bool[out.positional.size()] = name;
        out.positional.push_back(value);
      }
      overrides.push_back(Override{name, v});
    }
  }
  if (out.help) {
    out.help_text = help_text(describe(flags, false));
    return out;
  }
  for (const std::string& f : files) read_ini(f, out.config);
  for (const Override& o : overrides) config_set(out.config, o.name, o.value, "command line");
  out.config.resolve_defaults();
  return out;
}

Config parse_config_text(const std::string& text, const std::string& name) {
  Config c;
  std::istringstream in(text);
  read_ini(in, name, c);
  c.resolve_defaults();
  return c;
}

void reject_positional(const ParsedArgs& parsed, const std::string& usage) {
  if (parsed.positional.empty()) return;
  const std::string& word = parsed.positional[0];
  if (const auto it = parsed.after_bool.find(0); it != parsed.after_bool.end())
    fail("{} = '{}' is not a boolean; write true/false, 1/0, yes/no or on/off", it->second, word);
  fail("unexpected argument '{}'; options are written --section.key value ({})", word, usage);
}

}  // namespace mpigpt
