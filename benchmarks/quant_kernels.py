"""Micro-benchmark of the weight-only quantized matmuls on SmolLM2-135M's shapes, M = 1 and 64 rows:
bf16 F.linear (oneDNN / the skinny kernel's baseline), torch's packed int8/int4 CPU kernels, and
tokenloom's kernels (int8 per channel, Q8_0-style int8 per 32, int4 with tokenloom's group size and
with GGUF's 32). Prints median microseconds and the speed-up over bf16. The weights of one layer stay
in cache between calls, so this measures the kernels' arithmetic.

`--gguf-types` times the GGUF K-quant / Q5_0 kernels (quant/kquant.py) on Gemma 3 270M's shapes, each
type at each shape (random blocks), against bf16 at the same shape (F.linear, and for few rows the skinny
kernel the engine's bf16 decode uses) and Q8_0; every kernel route of the build at the row counts it
serves. `--gguf-decode-step` times a Gemma 3 270M Q4_K_M decode step's linears out of cache (18 layers,
each its own weights, with the file's types) against the same in bf16.

`--kquant-rows` times each K-quant / Q5_0 layer's vnni route against bf16 F.linear at 2048 x 2048,
5632 x 2048 and 576 x 1536, alternating the two per round (the medians of the rounds' ratios); with
`--kquant-layers 24`, out of cache: 24 different 2048 x 2048 layers per format in turn.

`--decode-step` measures what a decode step pays instead: 30 layers' worth of SmolLM2's four linears,
each its own weights (too many for the caches), called once each with --rows rows (each count in turn),
as the decode stack does; bf16 as the engine runs it (the skinny kernel for one row, oneDNN's prepacked
weight for more), the quantized formats through their auto route as the engine sets it at start-up
(quant/routing.py's measurement at the default step budget, printed first). Prints ms per step and the
weight bytes read per second. `--dots vnni,amx-int8,amx-bf16,expand` times Q4_1's tiles with each dot forced
instead (AMX CPUs; quant/routing.py chooses among them at start-up).

    python benchmarks/quant_kernels.py [--min-run-time 0.1] [--rows 1,64] [--decode-step [--rows 1,16,64]]
    python benchmarks/quant_kernels.py --decode-step --rows 16,32,64,128,256 --dots vnni,amx-int8,amx-bf16,expand
    python benchmarks/quant_kernels.py --gguf-types [--rows 1,4,8,64,256] | --gguf-decode-step
    python benchmarks/quant_kernels.py --kquant-rows --rows 2,4,8,16,32,64 [--threads 1] [--rounds 5]
                                       [--kquant-layers 24]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch.utils import benchmark

from tokenloom.quant.linear import Int4Linear, Int8Linear
from tokenloom.quant.weight_only import int4_group_size, quantize_int4, quantize_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def torch_int4(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed int4 layout: w ~= (q - 8) s + z."""
    q, d, m = quantize_int4(w, g)
    sz = torch.stack([d.float(), m.float() + 8 * d.float()], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2), sz


def decode_step(rows: list[int], repeats: int = 5, steps: int = 20, dots: list[str] | None = None) -> None:
    from tokenloom.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("--decode-step needs the C++ kernels")
    if dots:
        return _decode_step_dots(kernels, rows, repeats, steps, dots)
    from tokenloom.config import EngineConfig
    from tokenloom.quant.routing import measured

    budget = EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default
    print(measured(kernels, budget).describe())  # the crossovers the engine would run with
    torch.manual_seed(0)
    shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    formats = {
        "bf16": lambda w: _bf16(kernels, w),
        "int8": lambda w: _sized(Int8Linear.from_codes(*quantize_int8(w))),
        "Q8_0": lambda w: _sized(Int8Linear.from_codes(*_q8_0(w))),
        "int4 g128": lambda w: _sized(Int4Linear.from_codes(*quantize_int4(w, int4_group_size(w.shape[1], 128)))),
        "Q4_1": lambda w: _sized(Int4Linear.from_codes(*quantize_int4(w, 32))),
    }
    for label, make in formats.items():
        layers = [make(torch.randn(n, k) * 0.05) for _ in range(30) for n, k in shapes]
        nbytes = sum(b for _, b in layers)
        for m in rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
            calls = [(fn, xs[k]) for (fn, _), (_, k) in zip(layers, shapes * 30)]

            def step() -> None:
                for fn, x in calls:
                    fn(x)

            _report_step(f"{label} M={m}", 14, step, nbytes, repeats, steps)


def _decode_step_dots(kernels: object, rows: list[int], repeats: int, steps: int, dots: list[str]) -> None:
    """--decode-step --dots: Q4_1's 30 layers through the tiles with each dot forced (and from the first row),
    or `expand` (the weight expanded to bf16 for oneDNN), beside bf16 as the engine runs it."""
    from tokenloom.quant.routing import DOTS

    usable = kernels.quant_tile_dots()  # type: ignore[attr-defined]
    for d in dots:
        if d != "expand" and d not in usable:
            raise SystemExit(f"--dots: {d!r} is not usable here (usable: {', '.join(usable)}, expand)")
    torch.manual_seed(0)
    shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    weights = [torch.randn(n, k) * 0.05 for _ in range(30) for n, k in shapes]
    bf16 = [_bf16(kernels, w) for w in weights]
    q4 = [Int4Linear.from_codes(*quantize_int4(w, 32)) for w in weights]
    before = (kernels.quant_tile_max_rows(), kernels.quant_tile_dot(), kernels.quant_tile_dot_from())  # type: ignore[attr-defined]
    kernels.set_quant_tile_max_rows(1 << 20)  # type: ignore[attr-defined]
    kernels.set_quant_tile_dot_from(0)  # type: ignore[attr-defined]
    try:
        for m in rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
            ks = [k for _, k in shapes] * 30

            def bf16_step() -> None:
                for (fn, _), k in zip(bf16, ks):
                    fn(xs[k])

            _report_step(f"bf16 M={m}", 24, bf16_step, sum(b for _, b in bf16), repeats, steps)
            for d in dots:
                route = 2 if d == "expand" else 1
                if d != "expand":
                    kernels.set_quant_tile_dot(DOTS.index(d))  # type: ignore[attr-defined]

                def q_step(route: int = route) -> None:
                    for lay, k in zip(q4, ks):
                        kernels.quant_linear(xs[k], lay.codes, lay.scales, lay.mins, lay.bits, None, route)  # type: ignore[attr-defined]

                nbytes = sum(t.numel() * t.element_size() for lay in q4 for t in (lay.codes, lay.scales, lay.mins))
                _report_step(f"Q4_1 {d} M={m}", 24, q_step, nbytes, repeats, steps)
    finally:
        kernels.set_quant_tile_max_rows(before[0])  # type: ignore[attr-defined]
        kernels.set_quant_tile_dot(before[1])  # type: ignore[attr-defined]
        kernels.set_quant_tile_dot_from(before[2])  # type: ignore[attr-defined]


def _bf16(kernels: object, w: torch.Tensor) -> tuple[object, int]:
    """A dense layer as the engine runs it: the skinny kernel for one row, oneDNN's prepacked weight for
    2..PACKED_MAX_ROWS rows (models/layers.py Linear)."""
    wb = w.bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, 64)

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return kernels.skinny_linear(x, wb, None)  # type: ignore[attr-defined]
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    return run, wb.numel() * 2


def _report_step(label: str, width: int, step: Callable[[], None], nbytes: int, repeats: int, steps: int) -> None:
    """Time `step` (3 warm-up calls, then `repeats` runs of `steps` calls; the median of run medians) and print
    it with the bandwidth its `nbytes` of weights imply."""
    for _ in range(3):
        step()
    runs = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        runs.append(statistics.median(times))
    med = statistics.median(runs)
    print(f"{label:{width}s} {med * 1e3:6.3f} ms per step ({', '.join(f'{r * 1e3:.2f}' for r in runs)}), "
          f"{nbytes / 1e6:5.1f} MB -> {nbytes / med / 1e9:5.1f} GB/s")


def _sized(layer: Int8Linear | Int4Linear) -> tuple[object, int]:
    """The layer's kernel as the decode stack calls it (no nn.Module), and the bytes it reads."""
    kernels = layer.kernel_module()
    if kernels is None:
        raise SystemExit("--decode-step needs the quantized kernels (AVX512-BF16 and VNNI)")
    nbytes = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales, layer.mins) if t is not None)
    return (lambda x: kernels.quant_linear(x, layer.codes, layer.scales, layer.mins, layer.bits, None, 0)), nbytes


# Gemma 3 270M: (N, K) per linear, and the types its Q4_K_M file uses there (ffn_down: Q6_K or Q4_K)
GEMMA_SHAPES = {"qk": (1280, 640), "v": (256, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)}


def _gguf_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random (N, row bytes) blocks with small float16 scales where the format has them."""
    qk, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * k // qk, size), dtype=torch.uint8, generator=g)
    offsets = {GGMLQuantizationType.Q6_K: (208,), GGMLQuantizationType.Q5_0: (0,)}.get(qtype, (0, 2))
    for off in offsets:
        raw[:, off:off + 2] = (torch.rand(len(raw), 1, generator=g) * 1e-3).half().view(torch.uint8)
    return raw.reshape(n, -1)


def _median_us(fn: object, min_run_time: float) -> float:
    fn()  # type: ignore[operator]
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median * 1e6


def gguf_types(rows: list[int], min_run_time: float) -> None:
    from tokenloom.kernels import load_cpu_kernels
    from tokenloom.kernels.limits import SKINNY_MAX_ROWS
    from tokenloom.quant.kquant import KQUANT_TYPES, KQuantLinear

    kernels = load_cpu_kernels()
    routes = KQuantLinear.kernel_routes()
    print(f"threads {torch.get_num_threads()}; kquant routes {', '.join(routes) or 'none'}; "
          "median us (speed-up vs bf16 F.linear)")
    for name, (n, k) in GEMMA_SHAPES.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        q8 = Int8Linear.from_codes(*_q8_0(w))
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            fns: dict[str, object] = {"bf16": lambda: F.linear(x, w)}
            if m <= SKINNY_MAX_ROWS and kernels is not None and kernels.skinny_available():
                fns["bf16 skinny"] = lambda: kernels.skinny_linear(x, w, None)
            fns["Q8_0"] = lambda: q8(x)
            for qtype in KQUANT_TYPES:
                if k % GGML_QUANT_SIZES[qtype][0]:
                    continue
                layer = KQuantLinear(_gguf_blocks(qtype, n, k), qtype, k)
                for route in ("auto", *routes):
                    lay = KQuantLinear(layer.blocks, qtype, k, route=route)
                    fns[f"{qtype.name} {route}"] = lambda lay=lay: lay(x)
            times = {label: _median_us(fn, min_run_time) for label, fn in fns.items()}
            base = times["bf16"]
            print(f"{name:8s} {n:5d}x{k:<5d} M={m:<3d} " + "  ".join(f"{lbl} {us:.1f} ({base / us:.2f}x)"
                                                                   for lbl, us in times.items()))


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0's quantization: int8 per 32 inputs, d = max |w| / 127."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return torch.round(blocks / d).clamp(-127, 127).to(torch.int8).reshape(n, k), d.squeeze(-1).half()


def gguf_decode_step(repeats: int = 5, steps: int = 20) -> None:
    from tokenloom.kernels import load_cpu_kernels
    from tokenloom.quant.kquant import KQuantLinear

    kernels = load_cpu_kernels()
    if kernels is None or not KQuantLinear.kernel_routes():
        raise SystemExit("--gguf-decode-step needs the C++ kernels")
    Q = GGMLQuantizationType
    torch.manual_seed(0)
    # per layer as in the file: q+k Q5_0 (v Q8_0), o Q4_K, gate_up Q5_0, down Q6_K / Q4_K alternately
    plan = [("qk", Q.Q5_0), ("v", Q.Q8_0), ("o", Q.Q4_K), ("gate_up", Q.Q5_0), ("down", Q.Q6_K)]
    formats = {"bf16": None, "gguf Q4_K_M": plan}
    for label, types in formats.items():
        calls, nbytes = [], 0
        for i in range(18):
            for (name, qtype) in (types or [(s, None) for s in GEMMA_SHAPES]):
                n, k = GEMMA_SHAPES[name]
                x = torch.randn(1, k).bfloat16()
                if qtype is None:
                    w = (torch.randn(n, k) * 0.05).bfloat16()
                    calls.append(lambda x=x, w=w: kernels.skinny_linear(x, w, None))
                    nbytes += w.numel() * 2
                elif qtype == Q.Q8_0:
                    lay8 = Int8Linear.from_codes(*_q8_0(torch.randn(n, k) * 0.05))
                    calls.append(lambda x=x, lay=lay8: lay(x))
                    nbytes += lay8.codes.numel() + lay8.scales.numel() * 2
                else:
                    qt = Q.Q4_K if name == "down" and i % 2 else qtype
                    lay = KQuantLinear(_gguf_blocks(qt, n, k, seed=i), qt, k)
                    calls.append(lambda x=x, lay=lay: lay(x))
                    nbytes += lay.blocks.numel()

        def step() -> None:
            for fn in calls:
                fn()

        _report_step(label, 12, step, nbytes, repeats, steps)


def _paired_us(quant: Callable[[], object], bf16: Callable[[], object], rounds: int,
               clock: Callable[[], float]) -> tuple[float, float, float]:
    """Alternate the two (each ~10 ms of calls per round): (median quant us, median bf16 us, median of
    the rounds' bf16 / quant). Pairing within a round keeps the ratio fair when others share the cores."""
    quant(), bf16()
    t = clock()
    quant()
    inner = max(1, int(0.01 / max(clock() - t, 1e-6)))
    tq, tb = [], []
    for _ in range(rounds):
        for fn, out in ((quant, tq), (bf16, tb)):
            t = clock()
            for _ in range(inner):
                fn()
            out.append((clock() - t) / inner * 1e6)
    return statistics.median(tq), statistics.median(tb), statistics.median(b / q for q, b in zip(tq, tb))


# Llama-style 2048-wide layers (qkv/o, gate/up) and SmolLM2's mlp down (K = 1536: K-quants need K % 256 == 0)
KQUANT_ROW_SHAPES = ((2048, 2048), (5632, 2048), (576, 1536))


def kquant_rows(rows: list[int], rounds: int) -> None:
    """Each K-quant / Q5_0 layer through its vnni route (few-row kernel, then qtile.h's tiles from
    kquant.cpp's tile_min_rows) against bf16 F.linear (oneDNN) on the same shape, per row count. With one
    thread the clock is the thread's CPU time (robust to other processes on the cores)."""
    from tokenloom.quant.kquant import KQUANT_TYPES, KQuantLinear

    if "vnni" not in KQuantLinear.kernel_routes():
        raise SystemExit("--kquant-rows needs the AVX512-VNNI kernels")
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    print(f"threads {torch.get_num_threads()}; {rounds} paired rounds; us: vnni / bf16 F.linear = median "
          "speed-up (and against bf16 as the engine runs 2+ rows: oneDNN's prepacked weight)")
    torch.manual_seed(0)
    for n, k in KQUANT_ROW_SHAPES:
        w = (torch.randn(n, k) * 0.05).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        for qtype in KQUANT_TYPES:
            layer = KQuantLinear(_gguf_blocks(qtype, n, k), qtype, k, route="vnni")
            cells = []
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                q, b, ratio = _paired_us(lambda: layer(x), lambda: F.linear(x, w), rounds, clock)
                _, bp, ratio_p = _paired_us(
                    lambda: layer(x),
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), rounds, clock)
                cells.append(f"M{m} {q:.0f}/{b:.0f}={ratio:.2f}x ({ratio_p:.2f}x)")
            print(f"{qtype.name:5s} {n}x{k}: " + " ".join(cells), flush=True)


def kquant_rows_out_of_cache(rows: list[int], layers: int, rounds: int) -> None:
    """`layers` different 2048 x 2048 layers per format, called in turn (too many for the caches, as a
    model's), each format's vnni route against bf16 as the engine runs 2+ rows (prepacked oneDNN)."""
    from tokenloom.quant.kquant import KQUANT_TYPES, KQuantLinear

    if "vnni" not in KQuantLinear.kernel_routes():
        raise SystemExit("--kquant-layers needs the AVX512-VNNI kernels")
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    n = k = 2048
    torch.manual_seed(0)
    packed = [torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k) * 0.05).bfloat16(), 64) for _ in range(layers)]
    fmts: dict[str, list[Callable[[torch.Tensor], object]]] = {
        "bf16 packed": [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]}
    for qtype in KQUANT_TYPES:
        fmts[qtype.name] = [KQuantLinear(_gguf_blocks(qtype, n, k, seed=i), qtype, k, route="vnni")
                            for i in range(layers)]
    print(f"threads {torch.get_num_threads()}; {layers} layers of {n}x{k} in turn; "
          "us per layer (speed-up vs bf16 packed)")
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in fmts}
        for _ in range(rounds):
            for name, fns in fmts.items():
                t = clock()
                for fn in fns:
                    fn(x)
                times[name].append((clock() - t) / layers * 1e6)
        med = {name: statistics.median(v) for name, v in times.items()}
        base = med["bf16 packed"]
        print(f"M={m:<3d} " + "  ".join(f"{name} {us:.0f} ({base / us:.2f}x)" for name, us in med.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-run-time", type=float, default=0.1)
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--decode-step", action="store_true", help="time a decode step's worth of layers, out of cache")
    ap.add_argument("--dots", default="", help="--decode-step: Q4_1 through the tiles with each of these dots forced "
                    "(comma-separated: vnni, amx-int8, amx-bf16, and expand for the weight expanded to bf16)")
    ap.add_argument("--gguf-types", action="store_true", help="the GGUF K-quant / Q5_0 kernels on Gemma 3's shapes")
    ap.add_argument("--gguf-decode-step", action="store_true", help="a Gemma 3 270M Q4_K_M decode step's linears")
    ap.add_argument("--kquant-rows", action="store_true",
                    help="each K-quant / Q5_0 vnni route vs bf16 at --rows (e.g. 2,4,8,16,32,64) on 2048-wide shapes")
    ap.add_argument("--rounds", type=int, default=5, help="--kquant-rows: paired rounds per cell")
    ap.add_argument("--kquant-layers", type=int, default=0,
                    help="--kquant-rows out of cache: this many 2048x2048 layers per format in turn (e.g. 24)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.kquant_rows:
        if args.kquant_layers:
            kquant_rows_out_of_cache([int(r) for r in args.rows.split(",")], args.kquant_layers, args.rounds)
        else:
            kquant_rows([int(r) for r in args.rows.split(",")], args.rounds)
        return
    if args.gguf_types:
        gguf_types([int(r) for r in args.rows.split(",")], args.min_run_time)
        return
    if args.gguf_decode_step:
        gguf_decode_step()
        return
    if args.decode_step:
        decode_step([int(r) for r in args.rows.split(",")], dots=[d for d in args.dots.split(",") if d])
        return
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; median us (speed-up vs bf16)")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        g = int4_group_size(k, 128)
        q8, s8 = quantize_int8(w)
        q4 = quantize_int4(w, g)
        q32 = quantize_int4(w, 32)
        qg8 = torch.round(w.float().reshape(n, k // 32, 32) / (w.float().reshape(n, k // 32, 32).abs().amax(-1, keepdim=True) / 127)).clamp(-127, 127).to(torch.int8).reshape(n, k)
        sg8 = (w.float().reshape(n, k // 32, 32).abs().amax(-1) / 127).half()
        t4, sz = torch_int4(w, g)
        layers = {
            "int8": Int8Linear.from_codes(q8, s8), "q8_0": Int8Linear.from_codes(qg8, sg8),
            f"int4g{g}": Int4Linear.from_codes(*q4), "int4g32": Int4Linear.from_codes(*q32),
        }
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            fns = {
                "bf16": lambda: F.linear(x, w),
                "torch_int8": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8.view(-1).bfloat16()),
                "torch_int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4, g, sz),
                **{k_: (lambda lay=lay: lay(x)) for k_, lay in layers.items()},
            }
            times = {}
            for label, fn in fns.items():
                fn()
                t = benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=args.min_run_time)
                times[label] = t.median * 1e6
            base = times["bf16"]
            cells = "  ".join(f"{lbl} {us:8.1f} ({base / us:4.2f}x)" for lbl, us in times.items())
            print(f"{name:8s} {n:5d}x{k:<5d} M={m:<3d} {cells}")


if __name__ == "__main__":
    main()
