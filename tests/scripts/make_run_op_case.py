#!/usr/bin/env python3
"""Writes a captured KDA call for `kda-pool run-op` and an independent float64 reference.

The input file holds q, k, v, g, beta, A_log, dt_bias, cu_seqlens and initial_state with the
metadata run-op reads. The reference file holds `o` [T, HV, V] and `final_state`
[N, HV, K, V] (V-first with --layout vfirst) in float64, computed token by token with the
recurrence of section 2 of the KDA spec, from exactly the values stored in the input file
(inputs rounded to their dtype first). The reference starts from the f32 initial state; a
2-byte pool rounds it when the state is stored, which the caller's tolerance accounts for.

Needs numpy and safetensors. The input file is written by hand (numpy has no bfloat16); the
reference with safetensors.numpy.
"""

import argparse
import json
import struct
import sys

import numpy as np
from safetensors.numpy import save_file


def to_bf16_bits(x):
    """float32 array -> uint16 bfloat16 bits, rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def quantise(x, dtype):
    """(stored bytes, float64 values the stored tensor holds) for dtype f32 | f16 | bf16."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x.astype("<f4").tobytes(), x.astype(np.float64)
    if dtype == "f16":
        h = x.astype("<f2")
        return h.tobytes(), h.astype(np.float64)
    if dtype == "bf16":
        b = to_bf16_bits(x)
        return b.astype("<u2").tobytes(), from_bf16_bits(b).astype(np.float64)
    raise ValueError(dtype)


ST_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "i32": "I32", "i64": "I64"}


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (safetensors dtype, shape, bytes)."""
    header = {"__metadata__": metadata}
    offset = 0
    blobs = []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def softplus(z):
    return np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def reference(q, k, v, g, beta, a_log, dt_bias, bounds, state, opts):
    """float64 token recurrence (spec section 2). state: [N, HV, K, V] (K-first)."""
    t_total, h, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    group = hv // h
    scale = opts["scale"] if opts["scale"] is not None else kd ** -0.5
    o = np.zeros((t_total, hv, vd))
    state = state.copy()
    for n in range(len(bounds) - 1):
        for t in range(bounds[n], bounds[n + 1]):
            for j in range(hv):
                qh, kh = q[t, j // group].copy(), k[t, j // group].copy()
                if opts["l2norm"]:
                    qh = qh / np.sqrt(np.sum(qh * qh) + 1e-6)
                    kh = kh / np.sqrt(np.sum(kh * kh) + 1e-6)
                qh = qh * scale
                x = g[t, j]
                if opts["gate_in_kernel"]:
                    z = x + dt_bias[j]
                    if opts["lower_bound"] is not None:
                        gj = opts["lower_bound"] * sigmoid(np.exp(a_log[j]) * z)
                    else:
                        gj = -np.exp(a_log[j]) * softplus(z)
                else:
                    gj = x
                b = sigmoid(beta[t, j]) if opts["beta_sigmoid"] else beta[t, j]
                if opts["allow_neg_eigval"]:
                    b = 2.0 * b
                s = state[n, j] * np.exp(gj)[:, None]
                u = b * (v[t, j] - kh @ s)
                s = s + np.outer(kh, u)
                o[t, j] = qh @ s
                state[n, j] = s
    return o, state


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=["prefill", "decode"], required=True)
    p.add_argument("--seqlens", default="5,70,0,1", help="prefill: comma-separated lengths")
    p.add_argument("--seqs", type=int, default=3, help="decode: number of sequences")
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--hv", type=int, default=4)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--v", type=int, default=24)
    p.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32")
    p.add_argument("--index-dtype", choices=["i32", "i64"], default="i32")
    p.add_argument("--layout", choices=["kfirst", "vfirst"], default="kfirst")
    p.add_argument("--in-kernel", action="store_true",
                   help="raw gate and beta with l2norm, gate and beta sigmoid in the kernel")
    p.add_argument("--scale", type=float, default=None)
    p.add_argument("--lower-bound", type=float, default=None)
    p.add_argument("--allow-neg-eigval", action="store_true")
    p.add_argument("--no-initial-state", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", required=True)
    p.add_argument("--reference", required=True)
    a = p.parse_args()

    rng = np.random.default_rng(a.seed)
    if a.op == "decode":
        lens = [1] * a.seqs
    else:
        lens = [int(x) for x in a.seqlens.split(",") if x != ""]
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t_total, n = int(bounds[-1]), len(lens)
    h, hv, kd, vd = a.h, a.hv, a.k, a.v
    in_kernel = a.in_kernel

    a_log = np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32)
    dt = np.exp(rng.uniform(0, 1, hv * kd) * (np.log(0.1) - np.log(0.001)) + np.log(0.001))
    dt = np.maximum(dt, 1e-4)
    dt_bias = (dt + np.log(-np.expm1(-dt))).astype(np.float32)

    q = rng.standard_normal((t_total, h, kd)).astype(np.float32)
    k = rng.standard_normal((t_total, h, kd)).astype(np.float32)
    v = rng.standard_normal((t_total, hv, vd)).astype(np.float32)
    g_raw = rng.standard_normal((t_total, hv, kd)).astype(np.float32)
    b_raw = rng.standard_normal((t_total, hv)).astype(np.float32)
    if in_kernel:
        g, beta = g_raw, b_raw
    else:
        # Already activated inputs, and q, k normalised by the caller.
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        z = g_raw.astype(np.float64) + dt_bias.reshape(hv, kd)
        g = (-np.exp(a_log.astype(np.float64))[:, None] * softplus(z)).astype(np.float32)
        beta = sigmoid(b_raw.astype(np.float64)).astype(np.float32)
    state = rng.standard_normal((n, hv, kd, vd)).astype(np.float32)
    if a.no_initial_state:
        state[:] = 0.0

    tensors = {}
    values = {}
    for name, x in [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]:
        data, val = quantise(x, a.dtype)
        tensors[name] = (ST_DTYPES[a.dtype], x.shape, data)
        values[name] = val
    if in_kernel:
        tensors["A_log"] = ("F32", a_log.shape, a_log.astype("<f4").tobytes())
        tensors["dt_bias"] = ("F32", dt_bias.shape, dt_bias.astype("<f4").tobytes())
    idx = bounds.astype("<i4" if a.index_dtype == "i32" else "<i8")
    tensors["cu_seqlens"] = (ST_DTYPES[a.index_dtype], idx.shape, idx.tobytes())
    if not a.no_initial_state:
        stored = state if a.layout == "kfirst" else np.ascontiguousarray(state.transpose(0, 1, 3, 2))
        tensors["initial_state"] = ("F32", stored.shape, stored.astype("<f4").tobytes())

    tf = "true" if in_kernel else "false"
    metadata = {
        "use_qk_l2norm": tf,
        "use_gate_in_kernel": tf,
        "use_beta_sigmoid": tf,
        "state_layout": a.layout,
    }
    if a.scale is not None:
        metadata["scale"] = repr(a.scale)
    if a.lower_bound is not None:
        metadata["lower_bound"] = repr(a.lower_bound)
    if a.allow_neg_eigval:
        metadata["allow_neg_eigval"] = "true"
    write_safetensors(a.inputs, tensors, metadata)

    opts = {
        "scale": a.scale,
        "l2norm": in_kernel,
        "gate_in_kernel": in_kernel,
        "beta_sigmoid": in_kernel,
        "lower_bound": a.lower_bound,
        "allow_neg_eigval": a.allow_neg_eigval,
    }
    o, final = reference(
        values["q"], values["k"], values["v"], values["g"], values["beta"],
        a_log.astype(np.float64), dt_bias.astype(np.float64).reshape(hv, kd),
        [int(b) for b in bounds], state.astype(np.float64), opts,
    )
    if a.layout == "vfirst":
        final = final.transpose(0, 1, 3, 2)
    save_file({"o": np.ascontiguousarray(o), "final_state": np.ascontiguousarray(final)},
              a.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
