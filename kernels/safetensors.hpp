// Writes a model's parameters as safetensors (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, the data.
// Tensors are named as Keras does: dense_0/kernel (IN, OUT), dense_0/bias (OUT).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "kernels/model.hpp"

namespace ringmaster {

bool write_safetensors(const std::string& path, const model_spec& spec, const std::vector<float>& params,
                       const std::map<std::string, std::string>& metadata, std::string* error);

// Reads back what write_safetensors wrote (F32 tensors named as above) into a flat parameter buffer.
bool read_safetensors(const std::string& path, const model_spec& spec, std::vector<float>* params,
                      std::string* error);

}  // namespace ringmaster
