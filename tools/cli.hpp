// What the tools' command lines share: numbers are read whole and in range, never with atoi or
// std::sto* (atoi reads "abc" as 0 and "12abc" as 12; std::sto* throws).
#pragma once
#include <charconv>
#include <cstdio>
#include <string>
#include <type_traits>

namespace ringmaster::cli {

// `s` as a whole number in [lo, hi] into *out; false for anything else ("", "12abc", " 3", "-0x1", too big).
template <typename T>
bool parse_int(const std::string& s, long long lo, long long hi, T* out) {
  static_assert(std::is_signed_v<T>, "compared as long long: an unsigned value past LLONG_MAX would wrap");
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || (long long)v < lo || (long long)v > hi) return false;
  *out = v;
  return true;
}

// A number flag's value by parse_int; false after saying on stderr "TOOL: FLAG wants a whole number in
// LO-HI, not 'VALUE'" (the caller exits 2).
template <typename T>
bool number_flag(const char* tool, const std::string& flag, const std::string& value, long long lo, long long hi, T* out) {
  if (parse_int(value, lo, hi, out)) return true;
  std::fprintf(stderr, "%s: %s wants a whole number in %lld-%lld, not '%s'\n", tool, flag.c_str(), lo, hi, value.c_str());
  return false;
}

}  // namespace ringmaster::cli
