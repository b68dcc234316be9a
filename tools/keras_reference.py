#!/usr/bin/env python3
"""Keras reference for ringmaster-mnist's defaults: 784-512-512-10 (ReLU), Adam (Keras defaults),
global batch 128, 5 epochs, Fashion-MNIST from the Debian package. Prints the test accuracy per seed.
Needs TensorFlow (pip install tensorflow-cpu); a check, never a build dependency.

  python3 tools/keras_reference.py --seeds 1,2,3
"""
import argparse, gzip, time
import numpy as np

def idx(path):
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)

p = argparse.ArgumentParser()
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--seeds", default="1,2,3")
p.add_argument("--epochs", type=int, default=5)
a = p.parse_args()
import tensorflow as tf
x = idx(a.data + "/train-images-idx3-ubyte.gz").reshape(-1, 784).astype("float32") / 255
y = idx(a.data + "/train-labels-idx1-ubyte.gz").astype("int32")
xt = idx(a.data + "/t10k-images-idx3-ubyte.gz").reshape(-1, 784).astype("float32") / 255
yt = idx(a.data + "/t10k-labels-idx1-ubyte.gz").astype("int32")
for seed in [int(s) for s in a.seeds.split(",")]:
    tf.keras.utils.set_random_seed(seed)
    m = tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(512, "relu"),
                             tf.keras.layers.Dense(512, "relu"), tf.keras.layers.Dense(10)])
    m.compile(tf.keras.optimizers.Adam(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    t0 = time.time()
    m.fit(x, y, batch_size=128, epochs=a.epochs, verbose=0)
    secs = time.time() - t0
    loss, acc = m.evaluate(xt, yt, verbose=0)
    print(f"seed {seed}: test accuracy {acc:.4f}, test loss {loss:.4f}, {secs:.1f} s", flush=True)
