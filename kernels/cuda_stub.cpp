// Built instead of kernels/cuda_backend.cpp when ringmaster is configured without CUDA.
#include "kernels/backend.hpp"

namespace ringmaster {

std::unique_ptr<backend> make_cuda_backend(int, std::string* error) {
  *error = "this build of ringmaster has no CUDA support (configure with -DRINGMASTER_CUDA=ON)";
  return nullptr;
}

int cuda_device_count() { return 0; }

}  // namespace ringmaster
