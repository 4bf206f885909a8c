"""How far a float32 checkpoint's logits move when only its weights are rounded to bf16 (the CPU
backend, float32 activations): the part of a GPU-vs-CPU logits difference that the weights' bf16
copy alone explains. Pure Python (no numpy).

    python3 tools/bf16_weight_sensitivity.py build/dflash tests/fixtures/targets/qwen3_next_untied
"""
import argparse
import array
import json
import math
import os
import random
import shutil
import struct
import subprocess
import tempfile


def round_to_bf16(src, dst):
    """Copies checkpoint `src` to `dst` with every F32 tensor's values rounded to bf16 (nearest,
    ties to even), still stored as F32."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            continue
        raw = open(os.path.join(src, f), "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        data = bytearray(raw[8 + n:])
        for name, t in header.items():
            if name == "__metadata__" or t["dtype"] != "F32":
                continue
            begin, end = t["data_offsets"]
            bits = array.array("I")
            bits.frombytes(bytes(data[begin:end]))
            for i, x in enumerate(bits):
                bits[i] = (((x + 0x7FFF + ((x >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF
            data[begin:end] = bits.tobytes()
        open(os.path.join(dst, f), "wb").write(raw[:8 + n] + bytes(data))


def logits(dflash, model, ids, out):
    subprocess.run([dflash, "logits", "--device", "cpu", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
                    "--out", out], check=True, stdout=subprocess.DEVNULL)
    values = array.array("f")
    values.frombytes(open(out, "rb").read())
    return values


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dflash")
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn from 0..vocab-1")
    args = ap.parse_args()
    rng = random.Random(7)
    ids = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        rounded = os.path.join(tmp, "rounded")
        round_to_bf16(args.model, rounded)
        a = logits(args.dflash, args.model, ids, os.path.join(tmp, "a.f32"))
        b = logits(args.dflash, rounded, ids, os.path.join(tmp, "b.f32"))
    err = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / sum(x * x for x in a))
    print(f"{args.model}: weights rounded to bf16 move the logits of {args.tokens} tokens by rel. L2 {err:.2e}")


if __name__ == "__main__":
    main()
