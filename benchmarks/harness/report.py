"""Result rows, the arithmetic on them, and their output: a text table, results.json, results.csv."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SUITES = ("kernels", "model", "tuning", "overhead")

DEFINITIONS = {
    "ratio": "anchor_ms / tilekit_ms: > 1 means tilekit is faster",
    "timer": "CUDA events on one stream shared by tilekit and torch/CuPy, each rep timed alone, "
             "L2 written over (>= 256 MB) before every kernel and prefill rep, outside the timed region, "
             "median of reps",
    "kernel_ms": "GPU time of one CUDA-graph replay of one call (each side captured alone in a "
                 "torch.cuda.CUDAGraph on the shared stream), so host launch gaps count on neither side",
    "copy_bandwidth_gbs": "(bytes read + bytes written) / median time of a 1 GiB device-to-device "
                          "copy, best of cudaMemcpyAsync and a copy kernel; roofline of memory-bound rows",
    "matmul_peak_tflops": "2 * 8192^3 / median time of torch.matmul bf16 8192x8192x8192 on random data; "
                          "roofline of matmul, attention and prefill rows",
    "linear_flops": "2 * M * N * K (bias / GELU / residual epilogue not counted)",
    "attention_flops": "causal: 2 * B * H * T^2 * D (half of the 4 * B * H * T^2 * D of full attention)",
    "layer_norm_bytes": "2 * M * N * itemsize (read x, write y) + 2 * N * itemsize (weight, bias)",
    "gelu_bytes": "2 * n * itemsize (read x, write y)",
    "decode_attention_bytes": "2 * B * H * ctx * D * itemsize (the K and V cache read once)",
    "prefill_flops": "2 * B * T * (n_layer * W + V * C) + 2 * n_layer * B * T^2 * H * D (weight matmuls "
                     "incl. the LM head, plus causal attention); W = a layer's matmul weights: 12 * C^2 for "
                     "GPT-2, (2 * H + 2 * Hkv) * D * C + 3 * C * I for Llama; prefill floor = "
                     "prefill_flops / matmul_peak_tflops",
    "prefill_ms": "one forward with full logits (B x T x V), host included on both sides (the model API "
                  "as a caller sees it), CUDA events, L2 flushed, median of reps",
    "decode_ms_per_token": "wall time of a greedy generation (128 random prompt tokens -> 128 new), "
                           "CUDA-synchronized, median of 3 runs after the checked first run, divided by the "
                           "new tokens (one step serves the whole batch; the prompt prefill is included on "
                           "every side). Anchors: gpt-fast step = the model in PyTorch with static KV-cache "
                           "buffers, SDPA, argmax on the GPU, the step compiled with torch.compile("
                           "mode='reduce-overhead') (Inductor + CUDA graphs), prefill eager as in gpt-fast; "
                           "HF static = transformers generate with cache_implementation='static' (compiles "
                           "the decode forward); HF sdpa / eager = generate with the dynamic cache",
    "decode_floor_ms": "(weight bytes + KV-cache bytes read per step) / copy_bandwidth_gbs: itemsize x "
                       "parameters read (every one but an untied embedding table, of which the batch's rows; a tied "
                       "LM head once) plus 2 * n_layer * B * Hkv * D * "
                       "itemsize * the mean context (prompt + new / 2) (GPT-2: Hkv * D = C); prefill not "
                       "counted, so a lower bound",
    "pct_roofline": "tilekit % of floor: perf / roofline * 100 (kernels, prefill), or decode floor_ms / "
                    "ms_per_token * 100; anchor_pct_roofline the same for the anchor",
    "error": "||tilekit - anchor|| / ||anchor|| in float64 over the output checked before timing; decode "
             "rows: the logits of the first generated position. fp32 decode rows fail unless every greedy "
             "token equals the anchor's; bf16 decode rows report how many leading tokens agree "
             "(greedy_agreement, the least over the batch)",
    "compile_s": "seconds of a compiled anchor's first call (compile and checked run); each compiled anchor "
                 "has a per-preset budget, and shapes that would start after it is spent are skipped",
    "host_us_per_call": "overhead suite: median perf_counter_ns of one eager call over 1000 calls of a tiny "
                        "problem (the GPU never backs up; synchronized before), GPU work excluded; first "
                        "call = one call right after tilekit.autotune.store.reset() (plans forgotten, "
                        "kernels compiled), median of 20; floor = ct.launch of a one-array cuTile kernel",
}


@dataclass
class Row:
    """One tilekit-vs-anchor comparison."""

    suite: str                       # "kernels", "model", "tuning" or "overhead"
    name: str                        # "linear", "attention", ..., "prefill", "generate"
    label: str                       # short table label, e.g. "linear gpt2 attn.c_attn 768x2304"
    shape: str                       # full shape, e.g. "M=8192 K=768 N=2304"
    anchor: str                      # e.g. "torch.matmul"
    dtype: str = "bfloat16"
    unit: str = ""                   # unit of the perf columns: "TFLOP/s", "GB/s", "tok/s"
    work: float | None = None        # flops or bytes of one call (None for decode)
    tilekit_ms: float | None = None
    anchor_ms: float | None = None
    tilekit_p10_ms: float | None = None
    tilekit_p90_ms: float | None = None
    anchor_p10_ms: float | None = None
    anchor_p90_ms: float | None = None
    tilekit_perf: float | None = None
    anchor_perf: float | None = None
    roofline: float | None = None    # in `unit`, or a floor in ms when roofline_name ends in "_ms"
    roofline_name: str = ""
    pct_roofline: float | None = None
    anchor_pct_roofline: float | None = None
    error: float | None = None
    tolerance: float | None = None
    status: str = "ok"
    note: str = ""
    params: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return ratio(self.anchor_ms, self.tilekit_ms)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        return d


def ratio(anchor_ms, tilekit_ms) -> float | None:
    """anchor_ms / tilekit_ms (> 1: tilekit faster); None unless both are positive numbers."""
    if not anchor_ms or not tilekit_ms or anchor_ms <= 0 or tilekit_ms <= 0:
        return None
    return anchor_ms / tilekit_ms


def rate(work: float, ms: float | None, unit: str) -> float | None:
    """TFLOP/s or GB/s for `work` flops or bytes done in `ms` milliseconds."""
    if ms is None or ms <= 0 or work is None:
        return None
    if unit == "TFLOP/s":
        return work / ms / 1e9
    if unit == "GB/s":
        return work / ms / 1e6
    if unit == "tok/s":
        return work / ms * 1e3
    raise ValueError(f"unknown unit {unit!r}")


def pct(value: float | None, roof: float | None) -> float | None:
    if value is None or not roof:
        return None
    return 100.0 * value / roof


def param_count(config) -> int:
    """Parameters of a model config of any family: every tensor its checkpoint holds (a tied LM head once)."""
    from tilekit.models.families import family_of_config
    return sum(math.prod(s) for s in family_of_config(config).weights.state_dict_shapes(config).values())


def kv_width(config) -> int:
    """Key (or value) numbers per token per layer: n_kv_head * head_dim (GPT-2: n_embd)."""
    return getattr(config, "n_kv_head", config.n_head) * config.head_dim


def kv_values_per_token(config) -> int:
    """Numbers a KV cache keeps per token per layer: a key and a value (2 x kv_width), or MLA's latent entry (the
    latent and the rotary key, DeepSeek-V2)."""
    if hasattr(config, "kv_lora_rank"):
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * kv_width(config)


def attention_flops_per_pair(config) -> float:
    """FLOPs of one layer's attention per (query, key) pair, QK^T and PV over every head (MLA: its plain form,
    query-key width qk_head_dim, value width v_head_dim)."""
    if hasattr(config, "kv_lora_rank"):
        return 2.0 * config.n_head * (config.qk_head_dim + config.v_head_dim)
    return 4.0 * config.n_head * config.head_dim


def token_matmul_params(config) -> float:
    """Weights each token is multiplied by over all layers: every layer's matrices, and of a mixture-of-experts
    layer's experts (3-D tensors, one slice per expert) only the num_experts_per_tok routed and the shared ones."""
    from tilekit.models.families import family_of_config
    weights, total = family_of_config(config).weights, 0.0
    for i in range(config.n_layer):
        for shape in weights.block_shapes(config, i).values():
            if len(shape) == 2:
                total += math.prod(shape)
            elif len(shape) == 3:
                total += math.prod(shape) * _routed_share(config, shape[0], 1)
    return total


def _routed_share(config, experts: int, tokens: float) -> float:
    """The expected share of an experts tensor's `experts` slices (routed, then shared) that `tokens` tokens read,
    each routed to num_experts_per_tok of the routed ones uniformly at random."""
    E, S, K = config.n_routed_experts, config.n_shared_experts, config.num_experts_per_tok
    routed = E * (1 - (1 - K / E) ** tokens)
    return (routed + S) / experts


def decode_params(config, batch: int) -> float:
    """Parameters one decode step of `batch` tokens reads: streamed_params, of each experts tensor only the expected
    share its tokens are routed to (_routed_share)."""
    from tilekit.models.families import family_of_config
    weights, unread = family_of_config(config).weights, 0.0
    for i in range(config.n_layer):
        for shape in weights.block_shapes(config, i).values():
            if len(shape) == 3:
                unread += math.prod(shape) * (1 - _routed_share(config, shape[0], batch))
    return streamed_params(config, batch) - unread


def layer_matmul_params(config) -> int:
    """Weights one layer multiplies each token by: its matrices (q, k, v and output projections, the MLP)."""
    from tilekit.models.families import family_of_config
    shapes = family_of_config(config).weights.block_shapes(config, 0).values()
    return sum(math.prod(s) for s in shapes if len(s) == 2)


def streamed_params(config, batch: int) -> int:
    """Parameters one decode step of `batch` tokens reads: every tensor of the checkpoint but the token embedding
    table, of which only the batch's rows (all of it where the LM head is tied to it, GPT-2's always)."""
    unread = 0 if getattr(config, "tie_word_embeddings", True) else (config.vocab_size - batch) * config.n_embd
    return param_count(config) - unread


def streamed_bytes(model, batch: int) -> int:
    """Bytes of a built model's weights one decode step of `batch` tokens reads, as the model holds them (codes,
    scales and float tensors; a tensor-parallel rank's shard): every array but the embedding table, of which the
    batch's rows, or where the LM head is tied to it the head's rows (this rank's vocabulary slice)."""
    table = getattr(model, "embed", None)
    total = sum(a.nbytes for a in model.params.values())
    if table is None:
        return total
    tied = getattr(model.config, "tie_word_embeddings", True)
    read = model.head.nbytes if tied else batch * table.shape[1] * table.dtype.itemsize
    return total - table.nbytes + read


def mean_kv_bytes(config, batch: int, prompt: int, new: int, itemsize: int = 2) -> float:
    """KV-cache bytes the mean decode step of `new` tokens after a `prompt`-token prompt reads (keys and values)."""
    return 2 * config.n_layer * batch * kv_width(config) * itemsize * (prompt + new / 2)


def decode_floor_ms(config, batch: int, prompt: int, new: int, copy_gbs: float, itemsize: int = 2) -> float:
    """Time to read the step's weights (streamed_params) and the mean step's KV cache once at the copy bandwidth
    (see DEFINITIONS['decode_floor_ms'])."""
    kv = mean_kv_bytes(config, batch, prompt, new, itemsize)
    return (streamed_params(config, batch) * itemsize + kv) / (copy_gbs * 1e9) * 1e3


def prefill_flops(config, batch: int, seq: int) -> float:
    """FLOPs of one full-logits forward (see DEFINITIONS['prefill_flops'])."""
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    attention = 2.0 * L * batch * seq * seq * config.n_head * config.head_dim
    return 2.0 * batch * seq * (L * layer_matmul_params(config) + V * C) + attention


def fill_times(row: Row, tk: dict | None, an: dict | None) -> Row:
    """Copy two timer results (and the perf and % of roofline or floor they imply) into a row."""
    if tk is not None:
        row.tilekit_ms, row.tilekit_p10_ms, row.tilekit_p90_ms = tk["median_ms"], tk["p10_ms"], tk["p90_ms"]
    if an is not None:
        row.anchor_ms, row.anchor_p10_ms, row.anchor_p90_ms = an["median_ms"], an["p10_ms"], an["p90_ms"]
    if row.work is not None and row.unit:
        row.tilekit_perf = rate(row.work, row.tilekit_ms, row.unit)
        row.anchor_perf = rate(row.work, row.anchor_ms, row.unit)
    if row.roofline_name.endswith("_ms"):            # a floor time: % = floor / measured time
        row.pct_roofline = pct(row.roofline, row.tilekit_ms)
        row.anchor_pct_roofline = pct(row.roofline, row.anchor_ms)
    else:
        row.pct_roofline = pct(row.tilekit_perf, row.roofline)
        row.anchor_pct_roofline = pct(row.anchor_perf, row.roofline)
    return row


def short_error(e: BaseException) -> str:
    """'TypeName: first line of the message' (at most 300 characters of it)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def mark_error(rows: list, e: BaseException, log, who: str | None = None) -> list:
    """Log e's traceback and mark each row an error whose note says who failed and why; returns rows."""
    log(traceback.format_exc())
    for r in rows:
        r.status, r.note = "error", f"{who}: {short_error(e)}" if who else short_error(e)
    return rows


def strongest_first(rows: list, field=getattr) -> list:
    """Rows grouped by case in order of first appearance; in each case the fastest measured anchor
    first and rows that were not measured last. `field(row, name)` reads Row objects or dicts."""
    cases: dict[tuple, list] = {}
    for r in rows:
        cases.setdefault((field(r, "suite"), field(r, "name"), field(r, "label")), []).append(r)

    def speed(r):
        ms = field(r, "anchor_ms")
        return (field(r, "status") != "ok" or ms is None, ms or 0.0)
    return [r for group in cases.values() for r in sorted(group, key=speed)]


# -- text table ---------------------------------------------------------------------------------

COLUMNS = (("case", 36, "<"), ("anchor", 14, "<"), ("tk ms", 8, ">"), ("anch ms", 8, ">"),
           ("ratio", 6, ">"), ("tk%", 5, ">"), ("anch%", 5, ">"), ("err", 7, ">"))
WIDTH = 100
SECTIONS = (("kernels", None, "kernels: GPU time of one call (CUDA graph replay, L2 flushed); % of the roofline"),
            ("model", "prefill", "model prefill: one forward with full logits (B x T x V); % of the dense-peak floor"),
            ("model", "generate", "model decode: ms per new token (wall time); % of the weights + KV floor; "
                                  "err: 1st logits"),
            ("tuning", None, "tuning: the model with heuristic defaults (anchor, TILEKIT_AUTOTUNE=off) "
                             "vs the tuning databases"),
            ("overhead", None, "overhead: host ms per eager call, GPU work excluded; anchor: the torch op"))


def _num(v: float | None, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    a = abs(v)
    text = f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    if a >= 1e6:
        text = f"{v:.2e}"
    return text[:width]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def _cells(row: Row) -> list[str]:
    if row.status != "ok":
        tag = {"failed": "FAILED", "error": "ERROR", "skipped": "SKIP"}.get(row.status, row.status.upper())
        return [row.label, row.anchor, tag, "", "", "", "", "-" if row.error is None else f"{row.error:.1e}"]
    r = row.ratio
    return [row.label, row.anchor, _num(row.tilekit_ms, 8), _num(row.anchor_ms, 8),
            "-" if r is None else f"{r:.2f}x", _pct(row.pct_roofline), _pct(row.anchor_pct_roofline),
            "-" if row.error is None else f"{row.error:.1e}"]


def _line(cells: list[str]) -> str:
    parts = []
    for text, (_, width, align) in zip(cells, COLUMNS):
        text = text if len(text) <= width else text[:width - 1] + "~"
        parts.append(f"{text:{align}{width}}")
    return " ".join(parts).rstrip()


def _wrap(text: str, indent: str = "  ") -> list[str]:
    lines, line = [], indent
    for word in text.split():
        if len(line) + len(word) + 1 > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = indent + "  "
        line += word + " "
    if line.strip():
        lines.append(line.rstrip())
    return lines


def format_table(rows: list[Row], meta: dict | None = None) -> str:
    """The summary printed last: a header, one block per section, notes on rows that did not run."""
    meta = meta or {}
    out = []
    gpu = meta.get("gpu", {})
    cal = meta.get("calibration", {})
    head = f"tilekit benchmarks ({meta.get('mode', '?')}) on {gpu.get('name', '?')}"
    if gpu.get("sm_count"):
        head += f", {gpu['sm_count']} SMs"
    out.append(head[:WIDTH])
    if cal:
        out.append((f"rooflines: copy {_num(cal.get('copy_bandwidth_gbs'), 8)} GB/s (read+write), "
                    f"bf16 matmul {_num(cal.get('matmul_peak_tflops'), 8)} TFLOP/s (torch, measured)")[:WIDTH])
    out.append("ratio = anchor ms / tilekit ms (> 1: tilekit faster); err = relative error vs the anchor")
    header = _line([c[0] for c in COLUMNS])
    for suite, name, title in SECTIONS:
        block = [r for r in rows if r.suite == suite and (name is None or r.name == name)]
        if not block:
            continue
        out += ["", title[:WIDTH], header, "-" * len(header)]
        out += [_line(_cells(r)) for r in block]
    others = [r for r in rows if not any(r.suite == s and (n is None or r.name == n) for s, n, _ in SECTIONS)]
    if others:
        out += ["", "other", header, "-" * len(header)] + [_line(_cells(r)) for r in others]
    notes = [r for r in rows if r.status != "ok" and r.note]
    if notes:
        out += ["", "not measured:"]
        for r in notes:
            out += _wrap(f"{r.label} vs {r.anchor}: {r.status}: {r.note}")
    ok = sum(r.status == "ok" for r in rows)
    out += ["", f"{ok}/{len(rows)} rows measured; "
                f"{sum(r.status == 'failed' for r in rows)} failed checks, "
                f"{sum(r.status == 'error' for r in rows)} errors, "
                f"{sum(r.status == 'skipped' for r in rows)} skipped"]
    return "\n".join(out)


# -- files --------------------------------------------------------------------------------------

CSV_FIELDS = tuple(f.name for f in dataclasses.fields(Row) if f.name != "params") + ("ratio", "params")


def _clean(v):
    """JSON-safe: NaN and infinities become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(path: Path, meta: dict, rows: list[Row]) -> None:
    doc = {"meta": meta, "definitions": DEFINITIONS, "rows": [r.as_dict() for r in rows]}
    Path(path).write_text(json.dumps(_clean(doc), indent=2, default=str) + "\n")


def write_csv(path: Path, rows: list[Row]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            d = r.as_dict()
            d["params"] = json.dumps(d["params"], sort_keys=True)
            w.writerow({k: ("" if d[k] is None else d[k]) for k in CSV_FIELDS})


def exit_code(rows: list[Row]) -> int:
    """0 when nothing failed or broke (skips allowed), else 1."""
    return int(any(r.status in ("failed", "error") for r in rows))
