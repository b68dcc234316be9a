#include "kernels/safetensors.hpp"

#include <cstdio>
#include <cstring>
#include <fstream>

namespace ringmaster {
namespace {

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += c;
  }
  return o;
}

struct entry {
  std::string name;
  std::vector<size_t> shape;
  size_t offset, count;  // in floats, within the flat buffer
};

std::vector<entry> entries(const model_spec& spec) {
  std::vector<entry> e;
  for (size_t l = 0; l < spec.layers(); ++l) {
    const size_t in = spec.dims[l], out = spec.dims[l + 1];
    const std::string base = "dense_" + std::to_string(l);
    e.push_back({base + "/kernel", {in, out}, spec.weight_offset(l), in * out});
    e.push_back({base + "/bias", {out}, spec.bias_offset(l), out});
  }
  return e;
}

}  // namespace

bool write_safetensors(const std::string& path, const model_spec& spec, const std::vector<float>& params,
                       const std::map<std::string, std::string>& metadata, std::string* error) {
  if (params.size() != spec.param_count()) {
    *error = "parameter count does not match model " + spec.str();
    return false;
  }
  std::string h = "{\"__metadata__\":{";
  bool first = true;
  for (auto& [k, v] : metadata) {
    if (!first) h += ',';
    h += '"' + json_escape(k) + "\":\"" + json_escape(v) + '"';
    first = false;
  }
  h += "}";
  size_t byte = 0;
  for (const entry& e : entries(spec)) {
    h += ",\"" + e.name + "\":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) {
      if (i) h += ',';
      h += std::to_string(e.shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(byte) + "," + std::to_string(byte + e.count * 4) + "]}";
    byte += e.count * 4;
  }
  h += "}";
  while (h.size() % 8) h += ' ';  // the data starts 8-byte aligned
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    *error = path + ": cannot open for writing";
    return false;
  }
  unsigned char len[8];
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(h.data(), std::streamsize(h.size()));
  // Little-endian float32 in the flat buffer's order, which is the entries' order.
  f.write(reinterpret_cast<const char*>(params.data()), std::streamsize(params.size() * sizeof(float)));
  if (!f.flush()) {
    *error = path + ": write failed (disk full?)";
    return false;
  }
  return true;
}

bool read_safetensors(const std::string& path, const model_spec& spec, std::vector<float>* params,
                      std::string* error) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *error = path + ": cannot open";
    return false;
  }
  unsigned char len[8];
  if (!f.read(reinterpret_cast<char*>(len), 8)) {
    *error = path + ": truncated: no safetensors header";
    return false;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
  if (n > (1u << 24)) {
    *error = path + ": header length " + std::to_string(n) + " is implausible";
    return false;
  }
  std::string h(n, '\0');
  if (!f.read(h.data(), std::streamsize(n))) {
    *error = path + ": truncated header";
    return false;
  }
  params->assign(spec.param_count(), 0.0f);
  for (const entry& e : entries(spec)) {
    // Our own writer's layout: find the tensor's offsets and check them.
    const std::string key = "\"" + e.name + "\":{\"dtype\":\"F32\",\"shape\":[";
    auto at = h.find(key);
    if (at == std::string::npos) {
      *error = path + ": no F32 tensor " + e.name + " of model " + spec.str();
      return false;
    }
    auto off = h.find("\"data_offsets\":[", at);
    unsigned long long b0 = 0, b1 = 0;
    if (off == std::string::npos || std::sscanf(h.c_str() + off, "\"data_offsets\":[%llu,%llu]", &b0, &b1) != 2 ||
        b1 - b0 != e.count * 4) {
      *error = path + ": tensor " + e.name + " has the wrong size for model " + spec.str();
      return false;
    }
    f.seekg(std::streamoff(8 + n + b0));
    if (!f.read(reinterpret_cast<char*>(params->data() + e.offset), std::streamsize(e.count * 4))) {
      *error = path + ": truncated data in tensor " + e.name;
      return false;
    }
  }
  return true;
}

}  // namespace ringmaster
