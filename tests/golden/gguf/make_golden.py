#!/usr/bin/env python3
"""Makes the GGUF golden files read by tests/test_gguf.c, with the reference
reader and dequantizers of the `gguf` PyPI package (gguf-py, from llama.cpp).

    pip install gguf numpy
    python3 tests/golden/gguf/make_golden.py      # from the repository root

Writes, next to this script:
  synthetic.gguf  a small GGUF written by gguf.GGUFWriter: every metadata value
                  type, arrays of every element type, alignment 64, and tensors
                  of every supported type (F32, F16 with subnormals/inf/nan,
                  BF16, Q8_0, Q4_0, Q4_1), 1-D to 4-D.
  golden.txt      what gguf.GGUFReader and gguf.quants.dequantize read from
                  synthetic.gguf, the default model and two vocab GGUFs.

golden.txt is line based, fields separated by single spaces:
  file <where> <name>          where: model (models/), vocab (build/testdata/vocab/, from tests/data/vocab/*.gguf.xz), golden (this dir)
  version <n> / alignment <n> / n_kv <n> / n_tensors <n>
  kv <key> <vtype> <value>     scalars: integers in decimal, float32/float64 as
                               the hex of their IEEE bits, bool 0/1; strings:
                               <byte length> <hex of the first 48 bytes or '-'>
  arr <key> <elem vtype> <n>   then el <key> <index> <value> for a few indices
  tensor <name> <type> <ndim> <ne0> <ne1> <ne2> <ne3> <offset> <nbytes>
  vals <name> <first> <count> <hex of the f32 bits of each dequantized value>
Dequantized values are compared bit-exactly by the C test.
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
# the vocab files are stored xz-compressed (tests/data/vocab/*.gguf.xz); make
# decompresses them here
VOCAB = os.path.join(ROOT, "build", "testdata", "vocab")

STR_HEX = 48


def make_synthetic(path):
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(path, "synthetic")
    w.add_custom_alignment(64)
    w.add_key_value("t.u8", 200, VT.UINT8)
    w.add_key_value("t.i8", -100, VT.INT8)
    w.add_key_value("t.u16", 60000, VT.UINT16)
    w.add_key_value("t.i16", -30000, VT.INT16)
    w.add_key_value("t.u32", 4000000000, VT.UINT32)
    w.add_key_value("t.i32", -2000000000, VT.INT32)
    w.add_key_value("t.f32", 0.1, VT.FLOAT32)
    w.add_key_value("t.bool", True, VT.BOOL)
    w.add_key_value("t.str", "héllo \"world\"\n", VT.STRING)
    w.add_key_value("t.empty", "", VT.STRING)
    w.add_key_value("t.u64", 18446744073709551615, VT.UINT64)
    w.add_key_value("t.u64small", 12345678901234, VT.UINT64)
    w.add_key_value("t.i64", -9223372036854775807, VT.INT64)
    w.add_key_value("t.f64", 1e-300, VT.FLOAT64)
    for name, vt, vals in [
        ("a.u8", VT.UINT8, [0, 1, 255]), ("a.i8", VT.INT8, [-128, 0, 127]),
        ("a.u16", VT.UINT16, [1, 65535]), ("a.i16", VT.INT16, [-32768, 5]),
        ("a.u32", VT.UINT32, [7, 4294967295]), ("a.i32", VT.INT32, [-1, 2, -3, 4, 2147483647]),
        ("a.f32", VT.FLOAT32, [1.5, -2.25, 3.0e-39]), ("a.bool", VT.BOOL, [True, False, True]),
        ("a.str", VT.STRING, ["a", "", "ünïcode ✓", "x" * 100]),
        ("a.u64", VT.UINT64, [2**64 - 1, 3]), ("a.i64", VT.INT64, [-(2**63), 2**63 - 1]),
        ("a.f64", VT.FLOAT64, [np.pi, -0.0]),
    ]:
        w.add_key_value(name, vals, VT.ARRAY, sub_type=vt)

    def f16_special():
        x = rng.normal(size=(2, 64)).astype(np.float32)
        sp = [2.0**-24, -(2.0**-20), np.inf, -np.inf, np.nan, 65504.0, -0.0, 0.0, 6.1e-5, 1.0]
        x[0, : len(sp)] = sp
        return x

    w.add_tensor("f32.vec", rng.normal(size=(3, 64)).astype(np.float32))
    w.add_tensor("f32.cube", rng.normal(size=(2, 3, 32)).astype(np.float32))
    w.add_tensor("f16.mat", f16_special().astype(np.float16))
    bf = rng.normal(size=(2, 32)).astype(np.float32) * 1000
    bf[0, :5] = [np.inf, -np.inf, 1e-40, -0.0, 3.0]
    w.add_tensor("bf16.mat", gguf.quants.quantize(bf, QT.BF16), raw_dtype=QT.BF16)
    for qt, shape in [(QT.Q8_0, (4, 64)), (QT.Q4_0, (4, 64)), (QT.Q4_1, (4, 64)), (QT.Q8_0, (2, 2, 2, 32))]:
        x = rng.normal(size=shape).astype(np.float32)
        name = qt.name.lower() + (".mat" if len(shape) == 2 else ".4d")
        w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def scalar(vt, part):
    v = part[0]
    if vt == VT.FLOAT32:
        return "%08x" % int(np.asarray(v, dtype=np.float32).view(np.uint32))
    if vt == VT.FLOAT64:
        return "%016x" % int(np.asarray(v, dtype=np.float64).view(np.uint64))
    if vt == VT.BOOL:
        return "1" if v else "0"
    return str(int(v))


def string(b):
    b = bytes(b)
    return "%d %s" % (len(b), b[:STR_HEX].hex() or "-")


def dump(out, where, name, path, tensor_names):
    r = gguf.GGUFReader(path)
    kvs = [f for f in r.fields.values() if not f.name.startswith("GGUF.")]
    out.append("file %s %s" % (where, name))
    out.append("version %d" % int(r.fields["GGUF.version"].parts[-1][0]))
    out.append("alignment %d" % r.alignment)
    out.append("n_kv %d" % len(kvs))
    out.append("n_tensors %d" % len(r.tensors))
    for f in kvs:
        vt = f.types[0]
        if vt == VT.STRING:
            out.append("kv %s %d %s" % (f.name, vt, string(f.parts[f.data[0]])))
        elif vt != VT.ARRAY:
            out.append("kv %s %d %s" % (f.name, vt, scalar(vt, f.parts[f.data[0]])))
        else:
            et = f.types[1] if len(f.types) > 1 else VT.INT32
            n = len(f.data)
            out.append("arr %s %d %d" % (f.name, et, n))
            for i in sorted({0, 1, 2, 3, n // 2, n - 2, n - 1}):
                if 0 <= i < n:
                    p = f.parts[f.data[i]]
                    out.append("el %s %d %s" % (f.name, i, string(p) if et == VT.STRING else scalar(et, p)))
    by_name = {t.name: t for t in r.tensors}
    for tn in tensor_names:
        t = by_name[tn]
        ne = [int(x) for x in t.shape] + [1] * (4 - len(t.shape))
        out.append("tensor %s %d %d %s %d %d" % (t.name, int(t.tensor_type), len(t.shape),
                                                 " ".join(map(str, ne)), int(t.data_offset - r.data_offset),
                                                 int(t.n_bytes)))
        vals = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        n = len(vals)
        mid = (n // 2) // 32 * 32
        for first, count in sorted({(0, min(64, n)), (mid, min(32, n - mid)), (max(0, n - 32), min(32, n))}):
            bits = vals[first:first + count].view(np.uint32)
            out.append("vals %s %d %d %s" % (t.name, first, count, " ".join("%08x" % b for b in bits)))


def main():
    syn = os.path.join(HERE, "synthetic.gguf")
    make_synthetic(syn)
    out = []
    syn_tensors = [t.name for t in gguf.GGUFReader(syn).tensors]
    dump(out, "golden", "synthetic.gguf", syn, syn_tensors)
    model = "SmolLM2-135M-Instruct.Q4_1.gguf"
    dump(out, "model", model, os.path.join(ROOT, "models", model),
         ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight",
          "blk.29.attn_v.weight", "output_norm.weight"])
    for v in ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"]:
        dump(out, "vocab", v, os.path.join(VOCAB, v), [])
    with open(os.path.join(HERE, "golden.txt"), "w") as fp:
        fp.write("\n".join(out) + "\n")
    print("wrote %d lines" % len(out), file=sys.stderr)


if __name__ == "__main__":
    main()
