// libFuzzer harness: a job plan from the network (actors/job_plan.hpp's from_json and validate).
//
// Input: the JSON text. A plan that is accepted must validate, and survive to_json -> from_json unchanged.
#include <cstdint>
#include <string_view>

#include "actors/job_plan.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  job_plan plan;
  std::string err;
  if (!from_json(text, &plan, &err)) {
    require(!err.empty(), "a refused plan says why");
    return 0;
  }
  require(validate(plan, &err), "an accepted plan validates", err);
  const std::string json = to_json(plan);
  job_plan back;
  require(from_json(json, &back, &err), "an accepted plan reads back from its JSON", err);
  require(to_json(back) == json, "JSON round trip");
  return 0;
}
