#!/usr/bin/env python3
"""Keras reference for ringmaster-mnist: Adam (Keras defaults), global batch 128, 5 epochs, Fashion-MNIST from
the Debian package. Prints the test accuracy and training throughput per seed.
Needs TensorFlow (pip install tensorflow-cpu); a check, never a build dependency.

Models (--model, as ringmaster-mnist's):
  784-512-512-10   Dense layers with ReLU between them (the default; any widths, input 784)
  cnn              the Keras "simple MNIST convnet": conv 32 3x3, relu, maxpool 2, conv 64 3x3, relu,
                   maxpool 2, flatten, dropout 0.5, dense 10, on (28, 28, 1) images
--replicas N > 1 trains under tf.distribute.MirroredStrategy over N logical CPU devices (what the target
"Keras MirroredStrategy" figures used); 1 (the default) trains one model.

  python3 tools/keras_reference.py --seeds 1,2,3
  python3 tools/keras_reference.py --model cnn --replicas 2 --seeds 1
  ringmaster-mnist --model cnn --replicas 2 --batch 128 --epochs 5     # what it is compared with
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
p.add_argument("--model", default="784-512-512-10", help="MLP widths (784-...) or cnn")
p.add_argument("--replicas", type=int, default=1, help="MirroredStrategy over this many logical CPUs")
p.add_argument("--batch", type=int, default=128, help="global batch")
p.add_argument("--seeds", default="1,2,3")
p.add_argument("--epochs", type=int, default=5)
a = p.parse_args()
import tensorflow as tf
if a.replicas > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * a.replicas)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(a.replicas)])
else:
    strategy = tf.distribute.get_strategy()

cnn = a.model == "cnn"
if not cnn:
    dims = [int(d) for d in a.model.split("-")]
    if len(dims) < 2 or dims[0] != 784:
        p.error("--model must be cnn or widths starting with 784, e.g. 784-512-512-10")
shape = (28, 28, 1) if cnn else (784,)
x = idx(a.data + "/train-images-idx3-ubyte.gz").reshape(-1, *shape).astype("float32") / 255
y = idx(a.data + "/train-labels-idx1-ubyte.gz").astype("int32")
xt = idx(a.data + "/t10k-images-idx3-ubyte.gz").reshape(-1, *shape).astype("float32") / 255
yt = idx(a.data + "/t10k-labels-idx1-ubyte.gz").astype("int32")

def build():
    L = tf.keras.layers
    if cnn:  # https://keras.io/examples/vision/mnist_convnet/, logits out (the loss applies the softmax)
        return tf.keras.Sequential([tf.keras.Input(shape), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(2),
                                    L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(2), L.Flatten(),
                                    L.Dropout(0.5), L.Dense(10)])
    layers = [tf.keras.Input(shape)] + [L.Dense(d, "relu") for d in dims[1:-1]] + [L.Dense(dims[-1])]
    return tf.keras.Sequential(layers)

for seed in [int(s) for s in a.seeds.split(",")]:
    tf.keras.utils.set_random_seed(seed)
    with strategy.scope():
        m = build()
        m.compile(tf.keras.optimizers.Adam(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    t0 = time.time()
    m.fit(x, y, batch_size=a.batch, epochs=a.epochs, verbose=0)
    secs = time.time() - t0
    loss, acc = m.evaluate(xt, yt, batch_size=a.batch, verbose=0)
    print(f"seed {seed}: {a.model}, {a.replicas} replica(s): test accuracy {acc:.4f}, test loss {loss:.4f}, "
          f"{secs:.1f} s, {a.epochs * len(x) / secs:.0f} samples/s", flush=True)
