// Layers by name. A model description names each layer's type ("conv2d") and its settings; a registry
// turns that into a layer. The built-in layers come with with_builtins(); a program adds its own
// before it trains or serves as a node daemon:
//
//   ringmaster::layer_registry reg = ringmaster::layer_registry::with_builtins();
//   reg.add("channel_scale", [](const ringmaster::json& s, std::string* error) { ... return layer; });
//
// Settings arrive from the network on node daemons: read them with settings_reader, which never throws
// and names the bad key.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/layer.hpp"

namespace ringmaster {

// Text from a description, fit for an error message that travels in a key=value line: at most `max`
// characters, control characters and quotes escaped as JSON does, in single quotes: 'x\ny'.
std::string quoted(const std::string& text, size_t max = 40);
// Nesting depth of JSON text (strings skipped), checked before parsing text from outside: copying or
// printing a deeply nested value recurses, and a crafted file can nest 100,000 levels in a few bytes each.
int json_depth(const std::string& text);

// Keys and values in JSON text (strings skipped), an upper bound counted before parsing as json_depth is:
// a parsed value costs 16-100 bytes for the 2 bytes of text ("0,") it may take, so a size limit alone
// lets a crafted 64 MiB header take gigabytes.
size_t json_items(const std::string& text);

// Parses JSON text as nlohmann's parser does, with no exception escaping (a discarded value when it is
// not JSON; *why, if given, then says where or what: "at byte 30", "a number out of range"), and names
// in *twice the first key that appears twice in one object ("" if none): the parser keeps the last of
// the two, so a caller refuses text that says two things rather than guess.
json parse_json(const std::string& text, std::string* twice, std::string* why = nullptr);

// Makes a layer from its settings (the description's object, "type" included); null with *error.
using layer_factory = std::function<std::unique_ptr<layer>(const json& settings, std::string* error)>;

class layer_registry {
 public:
  // dense, conv2d, max_pool2d, flatten, relu, dropout.
  static layer_registry with_builtins();
  // False with *error when the name is taken or not a plain identifier ([a-z0-9_], 1-32 characters).
  bool add(const std::string& type, layer_factory make, std::string* error);
  // From {"type": NAME, ...}: null with *error for a missing or unknown type (listing the known ones) or
  // bad settings.
  std::unique_ptr<layer> create(const json& settings, std::string* error) const;
  std::vector<std::string> types() const;

 private:
  std::map<std::string, layer_factory> makers_;
};

// Reads a layer's settings without exceptions. Each call records the first problem; ok() says whether
// all went well and error() what went wrong ("'filters': expected an integer in 1..65536, got -3").
class settings_reader {
 public:
  explicit settings_reader(const json& s) : s_(s) {}
  // An integer in [lo, hi]; when absent, *out keeps its default unless required.
  settings_reader& integer(const char* key, int* out, int lo, int hi, bool required = false);
  // An integer or a pair [a, b] of them (kernel sizes, strides): both *a and *b are set.
  settings_reader& pair(const char* key, int* a, int* b, int lo, int hi, bool required = false);
  // A number in [lo, hi], checked as the float it is kept as (lo and hi rounded to floats too).
  settings_reader& number(const char* key, float* out, double lo, double hi, bool required = false);
  // One of the given words.
  settings_reader& word(const char* key, std::string* out, const std::vector<std::string>& allowed);
  // Refuses keys other than "type" and these (a misspelt setting is an error, not silently ignored).
  settings_reader& only(const std::vector<std::string>& keys);
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  const json* find(const char* key, bool required);
  void fail(const std::string& why) {
    if (error_.empty()) error_ = why;
  }
  const json& s_;
  std::string error_;
};

}  // namespace ringmaster
