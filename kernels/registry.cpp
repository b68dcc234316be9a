#include "kernels/registry.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

namespace ringmaster {

namespace {

// Whether the UTF-8 sequence at s[i] encodes a character that is invisible or reorders the text around
// it (U+061C, U+200B..U+200F, U+202A..U+202E, U+2060..U+2069, U+FEFF): printed as it is, a name could make
// an error message read otherwise than it says (Trojan Source, CVE-2021-42574). Its code point, or 0.
unsigned hidden_char(const std::string& s, size_t i) {
  const auto at = [&](size_t k) { return k < s.size() ? (unsigned char)s[k] : 0u; };
  if (at(i) == 0xD8 && at(i + 1) == 0x9C) return 0x061C;
  if (at(i) != 0xE2 && at(i) != 0xEF) return 0;
  const unsigned c = (at(i) & 0x0Fu) << 12 | (at(i + 1) & 0x3Fu) << 6 | (at(i + 2) & 0x3Fu);
  if ((at(i + 1) & 0xC0) != 0x80 || (at(i + 2) & 0xC0) != 0x80) return 0;
  const bool hidden = (c >= 0x200B && c <= 0x200F) || (c >= 0x202A && c <= 0x202E) || (c >= 0x2060 && c <= 0x2069) || c == 0xFEFF;
  return hidden ? c : 0;
}

}  // namespace

std::string quoted(const std::string& text, size_t max) {
  // dump() escapes control characters and quotes; replace invalid UTF-8 rather than throw on it.
  const std::string j = json(text.substr(0, max)).dump(-1, ' ', false, json::error_handler_t::replace);
  std::string out = "'";  // appends, not an operator+ chain (GCC 12 warns falsely on those, -Wrestrict)
  for (size_t i = 1; i + 1 < j.size();) {
    if (const unsigned c = hidden_char(j, i)) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04X", c);
      out.append(esc);
      i += c == 0x061C ? 2 : 3;
    } else {
      out.push_back(j[i++]);
    }
  }
  return out.append(text.size() > max ? "...'" : "'");
}

namespace {

// Calls f(c) for each character of JSON text outside its strings (escapes skipped with the string).
template <class F>
void outside_strings(const std::string& t, F f) {
  bool in_string = false;
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else {
      f(c);
    }
  }
}

}  // namespace

int json_depth(const std::string& t) {
  int depth = 0, deepest = 0;
  outside_strings(t, [&](char c) {
    if (c == '[' || c == '{') deepest = std::max(deepest, ++depth);
    else if (c == ']' || c == '}') depth = std::max(0, depth - 1);
  });
  return deepest;
}

size_t json_items(const std::string& t) {
  size_t items = 1;
  outside_strings(t, [&](char c) { items += c == ',' || c == ':' || c == '[' || c == '{'; });
  return items;
}

json parse_json(const std::string& text, std::string* twice, std::string* why) {
  twice->clear();
  std::vector<std::set<std::string>> open;  // keys of the objects being parsed, innermost last
  auto watch = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) open.emplace_back();
    else if (ev == json::parse_event_t::object_end && !open.empty()) open.pop_back();
    else if (ev == json::parse_event_t::key && !open.empty() && parsed.is_string() &&
             !open.back().insert(parsed.get<std::string>()).second && twice->empty())
      *twice = parsed.get<std::string>();
    return true;
  };
  try {  // (its exception is the only way to learn where it gave up)
    return json::parse(text, watch);
  } catch (const json::parse_error& e) {
    if (why) *why = "at byte " + std::to_string(e.byte);
  } catch (const json::out_of_range&) {  // 1e400: JSON, but no double holds it
    if (why) *why = "a number out of range";
  } catch (const json::exception&) {
  }
  return json(json::value_t::discarded);
}

bool layer_registry::add(const std::string& type, layer_factory make, std::string* error) {
  const bool plain = !type.empty() && type.size() <= 32 &&
                     type.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") == std::string::npos;
  if (!plain) {
    *error = "layer type " + quoted(type) + ": use 1-32 characters of a-z, 0-9 and _";
    return false;
  }
  if (!make) {
    *error = "layer type '" + type + "': no factory given";
    return false;
  }
  if (!makers_.emplace(type, std::move(make)).second) {
    *error = "layer type '" + type + "' is registered already";
    return false;
  }
  return true;
}

std::vector<std::string> layer_registry::types() const {
  std::vector<std::string> names;
  for (const auto& [name, make] : makers_) names.push_back(name);
  return names;
}

std::unique_ptr<layer> layer_registry::create(const json& settings, std::string* error) const {
  if (!settings.is_object()) {
    *error = "a layer is a JSON object such as {\"type\": \"dense\", \"units\": 10}, not " + std::string(settings.type_name());
    return nullptr;
  }
  auto t = settings.find("type");
  if (t == settings.end() || !t->is_string()) {
    *error = t == settings.end() ? "a layer has no \"type\"" : "a layer's \"type\" is a name such as \"dense\", not " + std::string(t->type_name());
    return nullptr;
  }
  const std::string& type = t->get_ref<const std::string&>();
  auto it = makers_.find(type);
  if (it == makers_.end()) {
    std::string known;
    for (const std::string& n : types()) known += (known.empty() ? "" : ", ") + n;
    *error = "unknown layer type " + quoted(type, 64) + (known.empty() ? " (no layer types are registered)" : " (known: " + known + ")");
    return nullptr;
  }
  std::string why;
  std::unique_ptr<layer> l;
  try {  // a user's factory may throw; a bad description must not take the process down
    l = it->second(settings, &why);
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
    why = "its factory threw";
  }
  if (!l) *error = type + ": " + (why.empty() ? "could not be created" : why);
  return l;
}

const json* settings_reader::find(const char* key, bool required) {
  auto it = s_.find(key);
  if (it == s_.end()) {
    if (required) fail(std::string("'") + key + "' is required");
    return nullptr;
  }
  return &*it;
}

namespace {
// An integer JSON value in [lo, hi] (lo >= 0 or not: unsigned values above hi are refused before any
// conversion could wrap).
bool as_int(const json& e, int lo, int hi, int* out) {
  if (e.is_number_unsigned()) {
    const unsigned long long x = e.get<unsigned long long>();
    if (x > (unsigned long long)(hi < 0 ? 0 : hi) || (long long)x < lo) return false;
    *out = int(x);
    return true;
  }
  if (!e.is_number_integer()) return false;
  const long long x = e.get<long long>();
  if (x < lo || x > hi) return false;
  *out = int(x);
  return true;
}
}  // namespace

settings_reader& settings_reader::integer(const char* key, int* out, int lo, int hi, bool required) {
  const json* v = find(key, required);
  if (!v || as_int(*v, lo, hi, out)) return *this;
  fail(std::string("'") + key + "': expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
       ", got " + v->dump().substr(0, 40));
  return *this;
}

settings_reader& settings_reader::pair(const char* key, int* a, int* b, int lo, int hi, bool required) {
  const json* v = find(key, required);
  if (!v) return *this;
  int x = 0, y = 0;
  if (as_int(*v, lo, hi, &x)) {
    *a = *b = x;
    return *this;
  }
  if (v->is_array() && v->size() == 2 && as_int((*v)[0], lo, hi, &x) && as_int((*v)[1], lo, hi, &y)) {
    *a = x, *b = y;
    return *this;
  }
  fail(std::string("'") + key + "': expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
       " or a pair of them, got " + v->dump().substr(0, 40));
  return *this;
}

settings_reader& settings_reader::number(const char* key, float* out, double lo, double hi, bool required) {
  const json* v = find(key, required);
  if (!v) return *this;
  if (v->is_number()) {
    // Checked as the float it is kept as: a float's own value written back (0.999 is kept as
    // 0.99900001287...) must read again, as a checkpoint's description does.
    const double x = v->get<double>();
    const float f = float(x);
    if (std::isfinite(x) && std::isfinite(f) && f >= float(lo) && f <= float(hi)) {
      *out = f;
      return *this;
    }
  }
  char range[64];  // [0, 0.999], not [0.000000, 0.999000]
  std::snprintf(range, sizeof range, "[%.6g, %.6g]", lo, hi);
  fail(std::string("'") + key + "': expected a number in " + range + ", got " + v->dump().substr(0, 40));
  return *this;
}

settings_reader& settings_reader::word(const char* key, std::string* out, const std::vector<std::string>& allowed) {
  const json* v = find(key, false);
  if (!v) return *this;
  if (v->is_string())
    for (const std::string& w : allowed)
      if (v->get_ref<const std::string&>() == w) {
        *out = w;
        return *this;
      }
  std::string list;
  for (const std::string& w : allowed) list += (list.empty() ? "" : " or ") + ("\"" + w + "\"");
  fail(std::string("'") + key + "': expected " + list + ", got " + v->dump().substr(0, 40));
  return *this;
}

settings_reader& settings_reader::only(const std::vector<std::string>& keys) {
  if (!s_.is_object()) return fail("settings are not a JSON object"), *this;
  for (auto it = s_.begin(); it != s_.end(); ++it) {
    if (it.key() == "type") continue;
    bool known = false;
    for (const std::string& k : keys) known = known || k == it.key();
    if (!known) {
      std::string list;
      for (const std::string& k : keys) list += (list.empty() ? "" : ", ") + k;
      fail("unknown setting " + quoted(it.key()) + (list.empty() ? " (it takes none)" : " (known: " + list + ")"));
    }
  }
  return *this;
}

}  // namespace ringmaster
