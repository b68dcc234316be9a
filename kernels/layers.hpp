// The built-in layers, written once against the backend's primitives (so each runs on the CPU and on a
// GPU), and the functions that describe them in a model:
//
//   using namespace ringmaster::layers;
//   ringmaster::sequential cnn{conv2d(32, 3), relu(), max_pool2d(2), conv2d(64, 3), relu(), max_pool2d(2),
//                              flatten(), dropout(0.5), dense(10)};
//
// Each describe-function returns the layer's JSON settings; layer_registry::with_builtins() turns them
// back into layers. Settings and saved parameters follow Keras (channels-last):
//   dense       {"units": N, "activation": "linear" | "relu"}   kernel (in, N), bias (N); any input, read as flat
//   conv2d      {"filters": F, "kernel": K | [KH, KW], "stride": S | [SH, SW], "padding": "valid" | "same",
//                "activation": "linear" | "relu"}  kernel (KH, KW, C, F), bias (F)
//               (activation "relu" is a fused ReLU, as Keras's activation="relu": one pass less)
//   max_pool2d  {"size": K | [KH, KW], "stride": S | [SH, SW]}   stride defaults to size; valid padding
//   flatten, relu                                  no settings
//   dropout     {"rate": R}                        0 <= R < 1; masks from (seed, epoch, sample index)
#pragma once
#include <string>

#include "kernels/layer.hpp"

namespace ringmaster::layers {

json dense(int units, const std::string& activation = "linear");
json conv2d(int filters, int kernel, int stride = 1, const std::string& padding = "valid",
            const std::string& activation = "linear");
json max_pool2d(int size, int stride = 0);  // stride 0: the size
json flatten();
json relu();
json dropout(double rate);
// A layer of any registered type, with its settings: custom("channel_scale", {{"init", 1.0}}).
json custom(const std::string& type, json settings = json::object());

}  // namespace ringmaster::layers
