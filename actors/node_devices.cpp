// What a node offers (--devices), one replica slot per device: parse_devices (actors/node_service.hpp).
// A node reads its own flag with it, and a launcher a node's hello_ack.
#include <algorithm>
#include <charconv>
#include <string>
#include <vector>

#include "actors/node_service.hpp"
#include "kernels/backend.hpp"

namespace ringmaster {

bool parse_devices(const std::string& text, std::vector<std::string>* slots, std::string* error) {
  // 1 to 4 digits (a node's word, to a launcher: never std::stoi).
  auto number = [](const std::string& n, int* v = nullptr) {
    int x = 0;
    const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), x);
    if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos || ec != std::errc() || end != n.data() + n.size())
      return false;
    if (v) *v = x;
    return true;
  };
  slots->clear();
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  if (text == "cuda") {  // every GPU of this machine, one replica each
    for (int g = 0, n = cuda_device_count(); g < n; ++g) slots->push_back("cuda:" + std::to_string(g));
    if (slots->empty()) *error = "--devices cuda: this machine has no usable CUDA device";
    return !slots->empty();
  }
  if (int n = 0; kind == "cpu" && colon != std::string::npos && number(text.substr(4), &n) && n > 0) {
    slots->assign(size_t(n), "cpu");
    return true;
  }
  if (kind != "cpu" && !kind.empty() && colon != std::string::npos) {  // KIND:I[,J...]: one replica each
    std::string list = text.substr(colon + 1);
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string id = list.substr(at, comma - at);
      if (!number(id)) {
        slots->clear();
        break;
      }
      slots->push_back(kind + ":" + id);
      at = comma + 1;
    }
    if (!slots->empty()) return true;
  }
  *error = "bad --devices '" + text + "': expected cpu:N (N CPU replicas), cuda (every GPU) or cuda:I[,J...] (GPUs by number)";
  return false;
}

}  // namespace ringmaster
