#include "kernels/safetensors.hpp"

#include "kernels/registry.hpp"

#include <fstream>

namespace ringmaster {

bool write_safetensors(const std::string& path, const model& m, const std::vector<float>& params,
                       const std::map<std::string, std::string>& metadata, std::string* error) {
  if (params.size() != m.param_count()) {
    *error = "parameter count " + std::to_string(params.size()) + " does not match model " + m.label();
    return false;
  }
  json h = json::object();
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  if (!meta.contains("model")) meta["model"] = m.description();
  h["__metadata__"] = meta;
  // The flat buffer's order is the tensors' order, so the data is the buffer as it is.
  for (const param_entry& p : m.params())
    h[p.name] = {{"dtype", "F32"}, {"shape", p.dims}, {"data_offsets", {p.offset * 4, (p.offset + p.count) * 4}}};
  std::string text = h.dump();
  while (text.size() % 8) text += ' ';  // the data starts 8-byte aligned
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    *error = path + ": cannot open for writing";
    return false;
  }
  unsigned char len[8];
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(text.data(), std::streamsize(text.size()));
  f.write(reinterpret_cast<const char*>(params.data()), std::streamsize(params.size() * sizeof(float)));
  if (!f.flush()) {
    *error = path + ": write failed (disk full?)";
    return false;
  }
  return true;
}

bool read_safetensors(const std::string& path, const model& m, std::vector<float>* params, std::string* error) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) {
    *error = path + ": cannot open";
    return false;
  }
  const uint64_t file_size = uint64_t(f.tellg());
  f.seekg(0);
  unsigned char len[8];
  if (!f.read(reinterpret_cast<char*>(len), 8)) {
    *error = path + ": truncated: no safetensors header";
    return false;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
  if (n > (1u << 24) || n > file_size - 8) {
    *error = path + ": header length " + std::to_string(n) + " is implausible for a file of " + std::to_string(file_size) + " bytes";
    return false;
  }
  std::string text(n, '\0');
  if (!f.read(text.data(), std::streamsize(n))) {
    *error = path + ": truncated header";
    return false;
  }
  // Our files nest 4 deep; a crafted one could nest deep enough to overflow the stack when copied.
  if (json_depth(text) > 8) {
    *error = path + ": the header nests deeper than a safetensors header does";
    return false;
  }
  const json h = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object()) {
    *error = path + ": the header is not a JSON object";
    return false;
  }
  const uint64_t data_bytes = file_size - 8 - n;
  params->assign(m.param_count(), 0.0f);
  for (const param_entry& p : m.params()) {
    auto t = h.find(p.name);
    if (t == h.end() || !t->is_object()) {
      *error = path + ": no tensor " + p.name + " (model " + m.label() + ")";
      return false;
    }
    // operator[] on a const json is undefined for a missing key: look up, or an empty value.
    const json none;
    auto field = [&](const char* k) -> const json& { auto it = t->find(k); return it == t->end() ? none : *it; };
    const json &dtype = field("dtype"), &dims = field("shape"), &offs = field("data_offsets");
    if (!dtype.is_string() || dtype.get_ref<const std::string&>() != "F32") {
      *error = path + ": tensor " + p.name + " is not F32";
      return false;
    }
    bool same = dims.is_array() && dims.size() == p.dims.size();
    for (size_t i = 0; same && i < p.dims.size(); ++i)
      same = dims[i].is_number_unsigned() && dims[i].get<uint64_t>() == p.dims[i];
    if (!same) {
      *error = path + ": tensor " + p.name + " has shape " + dims.dump().substr(0, 60) + ", the model needs " +
               json(p.dims).dump();
      return false;
    }
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned() ||
        offs[1].get<uint64_t>() < offs[0].get<uint64_t>() || offs[1].get<uint64_t>() > data_bytes ||
        offs[1].get<uint64_t>() - offs[0].get<uint64_t>() != p.count * 4) {
      *error = path + ": tensor " + p.name + " has bad data_offsets " + offs.dump().substr(0, 60);
      return false;
    }
    f.seekg(std::streamoff(8 + n + offs[0].get<uint64_t>()));
    if (!f.read(reinterpret_cast<char*>(params->data() + p.offset), std::streamsize(p.count * 4))) {
      *error = path + ": truncated data in tensor " + p.name;
      return false;
    }
  }
  return true;
}

}  // namespace ringmaster
