// A node daemon of one's own, built against an installed ringmaster: the built-in layers plus a custom
// one (times_two: y = 2x, no parameters), served with ringmaster::node_main.
#include <ringmaster/actors/node_main.hpp>
#include <ringmaster/kernels/layer.hpp>

class times_two final : public ringmaster::layer {
 public:
  std::string type() const override { return "times_two"; }
  bool build(const ringmaster::shape& in, ringmaster::shape* out, std::vector<ringmaster::param_info>*,
             std::string*) override {
    *out = in;
    return true;
  }
  void forward(const ringmaster::layer_io& io) const override {  // host backends only, as an example
    for (size_t i = 0; i < size_t(io.batch) * io.in.size(); ++i) io.y[i] = 2 * io.x[i];
  }
  void backward(const ringmaster::layer_io& io, const float* dy, float* dx) const override {
    if (dx)
      for (size_t i = 0; i < size_t(io.batch) * io.in.size(); ++i) dx[i] = 2 * dy[i];
  }
};

int main(int argc, char** argv) {
  auto layers = std::make_shared<ringmaster::layer_registry>(ringmaster::layer_registry::with_builtins());
  std::string error;
  if (!layers->add("times_two", [](const ringmaster::json&, std::string*) { return std::make_unique<times_two>(); },
                   &error))
    return 1;
  return ringmaster::node_main(argc, argv, layers);
}
