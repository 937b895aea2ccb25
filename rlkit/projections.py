"""The matrix products a CPU decode step runs, with their weights laid out for few rows: each
layer's projections side by side in one copy reordered for oneDNN (input-major where oneDNN does not
run the dtype; `fused`), a LoRA layer's adapters as a low-rank product beside it, and the LM head
reordered the same way (`head`). Copies of frozen weights (a LoRA policy's base model, its tied head)
are kept across calls while their tensors are unchanged (`kept`); trained ones are copied per call.
On a GPU each module runs itself."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {tag: (versions, value)}


def kept(module, tag: str, tensors: list, build):
    """`build()`, kept for the next call with `module` and `tag` while every tensor in `tensors` is
    frozen (no gradient) and unchanged (same storage, same version counter); built per call when any
    of them trains, so a trained weight's copy is never held between steps."""
    if any(t.requires_grad for t in tensors):
        return build()
    key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)
    slots = _KEPT.setdefault(module, {})
    if tag in slots and slots[tag][0] == key:
        return slots[tag][1]
    slots.pop(tag, None)  # the stale copy goes before the new one is built
    value = build()
    slots[tag] = (key, value)
    return value


def lora_adapters(m) -> list | None:
    """The active adapters of a vanilla LoRA layer (peft over an `nn.Linear`, adapters on and not
    merged, no DoRA or LoRA bias, no dropout active); None for anything else."""
    base, active = getattr(m, "base_layer", None), getattr(m, "active_adapters", [])
    if type(base) is not torch.nn.Linear or m.disable_adapters or m.merged or m.fan_in_fan_out:
        return None
    active = [a for a in active if a in m.lora_A]
    for a in active:
        variant = a in getattr(m, "lora_variant", {}) or m.lora_B[a].bias is not None  # DoRA, a LoRA bias
        if variant or (m.training and type(m.lora_dropout[a]) is not torch.nn.Identity):
            return None
    return active


def parts(m) -> tuple | None:
    """(weight [out, in], bias, adapters [(A [r, in], B [out, r], scaling)]) of a plain `nn.Linear`
    or a vanilla LoRA layer (`lora_adapters`): the map is x W^T + b + sum s (x A^T) B^T. None for
    anything else."""
    if type(m) is torch.nn.Linear:
        return m.weight, m.bias, []
    active = lora_adapters(m)
    if active is None:
        return None
    adapters = [(m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a]) for a in active]
    return m.base_layer.weight, m.base_layer.bias, adapters


def low_rank(found: list) -> tuple | None:
    """The adapters of side-by-side layers as one low-rank product: every A stacked, every scaled B
    in its layer's output columns.  -> (down [in, R], up [R, sum out]), None without adapters"""
    if not any(adapters for _, _, adapters in found):
        return None
    outs = [w.shape[0] for w, _, _ in found]
    down = torch.cat([a for _, _, adapters in found for a, _, _ in adapters]).t()  # [in, R]
    up = down.new_zeros(down.shape[1], sum(outs))  # [R, sum out]
    r = col = 0
    for out, (_, _, adapters) in zip(outs, found):
        for a, b, s in adapters:
            up[r : r + a.shape[0], col : col + out] = s * b.t()
            r += a.shape[0]
        col += out
    return down, up


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
FEW_ROWS = 128  # below: the reordered weight; from here on (a prefill) the weights as they are
HEAD_ROWS = (2, 192)  # the rows at which the reordered head was measured faster (SmolLM2's, one thread; 1 row: slower)


@torch.no_grad()
def fused(*linears):
    """One projection computing several linear layers side by side (outputs concatenated), plus
    their LoRA adapters as one low-rank product. On a CPU a decode step's few rows run on the weights
    concatenated into one copy (kept across calls while frozen): reordered for oneDNN's matmul where
    oneDNN runs the dtype (fp32), which streams them from memory faster than a GEMM that packs them on
    every call, else input-major. A prefill's many rows run on the weights themselves. On a GPU (where
    a copy of a large model's weights would not fit and cuBLAS needs none) and for anything else each
    module runs itself."""
    found = [parts(m) for m in linears]
    plain = all(p is not None for p in found) and len({p[1] is None for p in found}) == 1
    if not (plain and found[0][0].device.type == "cpu"):
        return lambda x: torch.cat([m(x) for m in linears], -1)
    onednn = ONEDNN and found[0][0].dtype == torch.float32
    tensors = [t for w, b, _ in found for t in (w, b) if t is not None]
    copy = reorder if onednn else (lambda w: w.detach().t().contiguous())  # [out, in] -> oneDNN's, or [in, out]
    weight = kept(linears[0], f"fused {onednn}", tensors, lambda: copy(torch.cat([w for w, _, _ in found])))
    bias = None if found[0][1] is None else torch.cat([b for _, b, _ in found])  # [sum out]
    adapters = low_rank(found)

    def project(x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2).contiguous()  # [n, in]
        if flat.shape[0] >= FEW_ROWS:
            return many_rows(flat, [w for w, _, _ in found], bias, adapters).view(*x.shape[:-1], -1)
        if onednn:
            y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")  # [n, sum out]
        else:
            y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)  # [n, sum out]
        if adapters is not None:
            y = y.addmm_(flat @ adapters[0], adapters[1])
        return y.view(*x.shape[:-1], -1)

    return project


def many_rows(flat: torch.Tensor, weights: list, bias, adapters) -> torch.Tensor:
    """x W^T (+ b) (+ the low-rank product) for many rows: each weight's product accumulated into
    its columns of one output, which starts as the bias and the adapters' product (no weight copy, no
    concatenation of outputs).  [n, in] -> [n, sum out]"""
    start = None if adapters is None else (flat @ adapters[0]) @ adapters[1]  # [n, sum out]
    if bias is not None:
        start = bias.expand(flat.shape[0], -1).clone() if start is None else start.add_(bias)
    y = flat.new_empty(flat.shape[0], sum(w.shape[0] for w in weights)) if start is None else start  # [n, sum out]
    col = 0
    for w in weights:
        y[:, col : col + w.shape[0]].addmm_(flat, w.t(), beta=0 if start is None else 1)
        col += w.shape[0]
    return y


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [out, in] in oneDNN's layout for its matmul (any number of rows from 2)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)


@torch.no_grad()
def head(lm_head):
    """The LM head of a decode step. On a CPU with oneDNN, an fp32 head without bias runs on its
    weight reordered for oneDNN (kept across calls while frozen): a 49k-vocabulary head over 32 rows
    in about two thirds of the time of a GEMM that packs it on every call, the same logits to float
    rounding. Outside `HEAD_ROWS`, or anything else: the module itself."""
    w = getattr(lm_head, "weight", None)
    lean = type(lm_head) is torch.nn.Linear and lm_head.bias is None and w.dtype == torch.float32
    if not (lean and ONEDNN and w.device.type == "cpu"):
        return lm_head
    reordered = kept(lm_head, "head", [w], lambda: reorder(w))

    def logits(h: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        if not HEAD_ROWS[0] <= h.shape[0] <= HEAD_ROWS[1]:
            return F.linear(h, w)
        return torch.ops.mkldnn._linear_pointwise(h.contiguous(), reordered, None, "none", [], "")

    return logits
