"""Instructions per element of fp8_adamw_step_kernel's hot path, counted in its SASS (no GPU needed).

The kernel is a persistent loop over 512-column tiles, 16 elements per lane. This script compiles
csrc/cuda/adamw.cu with the build's nvcc flags (or takes a cubin), disassembles it with line information
(nvdisasm -g -gi), and walks the tile loop's control flow from its header to its back-edge, choosing at each
conditional branch the direction a typical tile takes: every group expanded (k != 1) with normal values, no
zero / non-finite / subnormal element, whole lanes of an aligned tensor, the fast paths of sqrt and division.
Branches are decided by the source line they come from (rules below, written against the source text, so a
change of the kernel may need a change of a rule: the walk stops and prints the branch it cannot decide).
Counts are dynamic for that path: each executed SASS instruction once, including branches, BSSY/BSYNC and
the uniform-datapath instructions; divided by the 16 elements of a lane.

  python tools/sass_hot_path.py                      # fp32 param and grad, G = 128
  python tools/sass_hot_path.py --dtypes bf16 --group-size 16 --by-line

Needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm puts one in site-packages/nvidia/cu13/bin).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = os.path.join(ROOT, "csrc", "cuda", "adamw.cu")
MATH = os.path.join(ROOT, "csrc", "include", "coat", "detail", "adamw_math.h")
NVCC_FLAGS = ["-O3", "-std=c++17", "-prec-div=true", "-prec-sqrt=true", "-ftz=false", "-fmad=false", "-lineinfo"]
ELEMENTS_PER_TILE_LANE = 16

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def opcode(text: str) -> str:
    return (text.split(None, 1)[1] if text.startswith("@") else text).split()[0]


def parse(listing: str) -> dict[str, list[dict]]:
    """nvdisasm -g -gi output -> {function: [{addr, text, labels, chain}]}; chain = [(file, line)] innermost
    first (the inlining chain)."""
    functions: dict[str, list[dict]] = {}
    current = None
    chain: list[tuple[str, int]] = []
    labels: list[str] = []
    after_instruction = False
    for raw in listing.splitlines():
        if raw.startswith("//--------------------- .text."):
            current = functions.setdefault(raw.split(".text.")[1].split(" ")[0], [])
            continue
        if current is None:
            continue
        m = LINE.search(raw)
        if m:
            if after_instruction:
                chain, after_instruction = [], False
            chain.append((os.path.basename(m.group(1)), int(m.group(2))))
            continue
        m = LABEL.match(raw)
        if m:
            labels.append(m.group(1))
            continue
        m = INSTRUCTION.match(raw)
        if m:
            current.append(dict(addr=int(m.group(1), 16), text=m.group(2).strip(), labels=labels, chain=list(chain)))
            labels, after_instruction = [], True
    return functions


class Source:
    def __init__(self, path: str):
        self.name = os.path.basename(path)
        self.lines = open(path).read().split("\n")

    def find(self, snippet: str, after: int = 0) -> int:
        for number, line in enumerate(self.lines, 1):
            if number > after and snippet in line:
                return number
        raise KeyError(f"{self.name}: no line containing {snippet!r} (update the rules of {__file__})")

    def key(self, snippet: str, after: int = 0) -> str:
        return f"{self.name}:{self.find(snippet, after)}"


def rules_for(cu: Source, h: Source, dtypes: str, group_size: int):
    """(cold source lines, branch rules): the hot path of a typical tile."""
    cold: set[str] = set()

    def cold_lines(first: str, count: int = 1, last: str | None = None):
        a = cu.find(first)
        b = cu.find(last, a - 1) if last else a + count - 1
        cold.update(f"{cu.name}:{n}" for n in range(a, b + 1))

    # element-by-element I/O, the paths of k == 1 groups, subnormal groups, zero / non-finite elements
    cold_lines("load_values_scalar(t.param, t.param_dtype", 4)
    cold_lines("store_params_scalar(t.param, t.param_dtype")
    cold_lines("store_codes_scalar(t.exp_avg, span.first", 2)
    cold_lines("out[i] = i < count ? coat_load_f32")
    cold_lines("if (i < count) coat_store_param(data")
    cold_lines("if (i < count) c.w[i / 4] |= static_cast<uint32_t>(codes[first + i])")
    cold_lines("if (i < count) codes[first + i] = static_cast<uint8_t>")
    cold_lines("for (int i = 0; i < kValuesPerLane; ++i) out[i] = d.c * (t->fp8_value[format]")
    cold_lines("for (int i = 0; i < kValuesPerLane; ++i) out[i] = coat_decode(")
    cold_lines("c.w[i / 4] |= static_cast<uint32_t>(coat_encode(x[i], &e, &f, format, t))")
    cold_lines("if (coat_is_finite(x[i])) r.range.amax = fmaxf(r.range.amax, fabsf(x[i]));")
    cold_lines("const uint32_t code = a == 0u ? (bits >> 24) & 0x80u : 0x7Fu;",
               last="c.w[i / 4] = (c.w[i / 4] & ~(0xFFu << (8 * (i % 4)))) | (code << (8 * (i % 4)));")
    cold_lines("for (int i = 0; i < kValuesPerLane; ++i) p[i] = coat_adamw_update(p[i]")
    # the dtypes not in use
    if dtypes == "fp32":
        cold_lines("const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>",
                   last="out[8 * q + 2 * i + 1] = coat_f16_to_f32")
        cold_lines("uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(data) + first);",
                   last="out[q] = make_uint4(w[0], w[1], w[2], w[3]);")
    else:
        cold_lines("const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(data) + first);",
                   last="out[4 * q] = a.x; out[4 * q + 1] = a.y;")
        cold_lines("float4* out = reinterpret_cast<float4*>(static_cast<float*>(data) + first);", 3)
        cold_lines("out[8 * q + 2 * i] = coat_f16_to_f32", 2)
    split = group_size >= 32
    if split:
        cold_lines("m_dec = coat_decoder_make(load_meta(t.exp_avg_meta + meta_offset", 2)
        cold_lines("m_enc = new_encoder(m_lane.range", 4)
    else:
        cold_lines("coat_decoder_make(load_meta((odd ? t.exp_avg_sq_meta : t.exp_avg_meta) + meta_offset", 4)
        cold_lines("const coat_range r = group_range_split(", 7)

    meta = h.find("COAT_INLINE coat_encoder coat_encoder_of_range")
    second_split = cu.find("if (split) {", cu.find("const LaneRange m_lane = lane_range(m)"))
    rules = {
        cu.key("if (divisor.exact_by_inverse) {"): "to:" + cu.key("p[i] = coat_adamw_update_by_inverse("),
        # the butterfly's steps at distances 2 and 4 merge when they stay inside the group
        cu.key("if (offset < lanes_per_group) mine = merge_from(mine, offset);"):
            "seq:" + ",".join("fallthrough" if offset < group_size // 16 else "taken" for offset in (2, 4)),
        cu.key("if (store) coat_meta_store(m, meta);"): "fallthrough",
        cu.key("if (specials) {"): "taken",
        cu.key("if (d.linear) {"): "to:" + cu.key("} else if (d.fast_scaling) {"),
        cu.key("if (!r.specials) {"): "to:" + cu.key("r.range.amax = __uint_as_float((high_key + 2u) >> 1);"),
        h.key("if (expand && r.amax > 0.0f) {", meta): "fallthrough",
        h.key("if (mean >= COAT_MIN_SCALE && mean <= coat_bf16_max()) {", meta): "fallthrough",
        h.key("if (log2_range > 0.0f)", meta): "fallthrough",
        h.key("if (m.k == 1.0f) {", meta): "to:" + h.key("const float log2_ratio = (float)(high.exponent - lc.exponent)", meta),
    }
    if split:
        rules[f"{cu.name}:{second_split}"] = "to:" + cu.key("const coat_range r = group_range_split(")
    else:
        rules[f"{cu.name}:{second_split}"] = "to:" + cu.key("m_enc = new_encoder(m_lane.range")
    return cold, rules


def walk(ins: list[dict], cold: set[str], rules: dict[str, str], loop_line: str, header_line: str):
    """The hot path of one iteration of the loop whose back-edge comes from source line loop_line and whose
    body holds header_line (both "file:line"): every instruction from the loop's head to its back-edge,
    conditional branches decided by `rules` (source line -> "taken", "fallthrough", "to:LINE|LINE" toward
    the nearer of those lines, "into:LINE|LINE" toward more instructions from those lines (of the next 60, up to the
    branch's own line),
    "away:LINE|LINE" toward fewer, "text:TEXT" toward the nearer instruction holding TEXT, or
    "seq:DIR,DIR,..." one per visit) after two defaults: away from a block that calls a slow path, away
    from a block whose instructions mostly come from `cold` lines."""
    label_at = {label: k for k, i in enumerate(ins) for label in i["labels"]}

    def chain(i):
        return [f"{f}:{l}" for f, l in i["chain"]]

    def block(k):  # the instructions from k to the next branch or label
        out = []
        while k < len(ins):
            out.append(ins[k])
            if opcode(ins[k]["text"]).startswith(("BRA", "EXIT", "RET", "CALL")) or (
                    k + 1 < len(ins) and ins[k + 1]["labels"]):
                break
            k += 1
        return out

    def slow(k):  # a block that calls a slow path (sqrt, division, a shuffle's divergent fallback)
        return any(opcode(i["text"]).startswith(("CALL", "WARPSYNC")) for i in block(k))

    def mostly_cold(k):
        b = block(k)
        return 2 * sum(any(c in cold for c in chain(i)) for i in b) > len(b)

    def distance(k, wanted):  # (a BSYNC closes a region and carries its lines, wherever it leads)
        for q in range(k, min(k + 300, len(ins))):
            if opcode(ins[q]["text"]) != "BSYNC" and any(w in chain(ins[q]) for w in wanted):
                return q - k
        return 1 << 30

    def share(k, wanted, own):  # of the next 60 instructions, until the branch's own line comes back after
        count, left = 0, False  # others (the next visit of the statement: the next iteration of an unrolled
        for q in range(k, min(k + 60, len(ins))):  # loop), those from the wanted lines
            mine = own in chain(ins[q])
            if mine and left:
                break
            left = left or not mine
            count += any(w in chain(ins[q]) for w in wanted)
        return count

    def text_distance(k, wanted):
        for q in range(k, min(k + 300, len(ins))):
            if wanted in ins[q]["text"]:
                return q - k
        return 1 << 30

    visits = collections.Counter()

    def decide(k, taken, fallthrough):
        i = ins[k]
        if slow(taken) != slow(fallthrough):
            return fallthrough if slow(taken) else taken
        if mostly_cold(taken) != mostly_cold(fallthrough):
            return fallthrough if mostly_cold(taken) else taken
        for c in chain(i):
            if c in rules:
                rule = rules[c]
                if rule.startswith("away:"):  # away from the lines: into the other direction
                    rule, taken, fallthrough = "into:" + rule[5:], fallthrough, taken
                if rule.startswith(("to:", "into:", "text:")):
                    if rule.startswith("to:"):
                        wanted = rule[3:].split("|")
                        dt, df = distance(taken, wanted), distance(fallthrough, wanted)
                    elif rule.startswith("into:"):
                        wanted = rule[5:].split("|")
                        dt, df = -share(taken, wanted, c), -share(fallthrough, wanted, c)
                    else:
                        dt, df = text_distance(taken, rule[5:]), text_distance(fallthrough, rule[5:])
                    if dt == df:
                        raise RuntimeError(f"rule {c}={rule} does not separate the branch at {i['addr']:#x}")
                    return taken if dt < df else fallthrough
                if rule.startswith("seq:"):  # one direction per visit of this branch, in order
                    directions = rule[4:].split(",")
                    rule = directions[min(visits[c], len(directions) - 1)]
                    visits[c] += 1
                return taken if rule == "taken" else fallthrough
        raise RuntimeError(f"no rule for the branch at {i['addr']:#x} {i['text']} ({' <- '.join(chain(i)[:4])})")

    # the back-edge: a conditional branch of loop_line to an earlier instruction, with header_line in between
    # (the widest such loop)
    backedge = header = None
    for k, i in enumerate(ins):
        if opcode(i["text"]) == "BRA" and i["text"].startswith("@") and loop_line in chain(i):
            target = label_at[TARGET.search(i["text"]).group(1)]
            if target < k and (header is None or target < header) and any(
                    header_line in chain(ins[q]) for q in range(target, k)):
                backedge, header = k, target
    if backedge is None:
        raise RuntimeError("loop not found")
    path, k = [], header
    while True:
        i = ins[k]
        path.append(i)
        if k == backedge:
            return path
        op, predicated = opcode(i["text"]), i["text"].startswith("@")
        if op.startswith("BRA.DIV"):  # taken only when the warp has diverged
            k += 1
        elif op.startswith("BRA"):
            target = label_at[TARGET.search(i["text"]).group(1)]
            k = decide(k, target, k + 1) if predicated else target
        elif op.startswith(("EXIT", "CALL", "RET")) and not predicated:
            raise RuntimeError(f"the walk reached {i['text']} at {i['addr']:#x}")
        else:
            k += 1
        if len(path) > 200000:
            raise RuntimeError("runaway walk")


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    import site
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for sub in ("cu13", "cu12"):
            candidate = os.path.join(base, "nvidia", sub, "bin", name)
            if os.path.exists(candidate):
                return candidate
    sys.exit(f"{name} not found (on PATH or in site-packages/nvidia/cu*/bin)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cubin", help="an sm_90 cubin of csrc/cuda/adamw.cu (default: compile one)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dtypes", choices=["fp32", "bf16"], default="fp32",
                        help="param and grad dtype (fp32 / fp32 or bf16 / bf16)")
    parser.add_argument("--group-size", type=int, choices=[16, 32, 64, 128], default=128)
    parser.add_argument("--by-line", action="store_true", help="instructions per source line of step_tile")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cubin = args.cubin
        if cubin is None:
            cubin = os.path.join(tmp, "adamw.cubin")
            subprocess.run([tool("nvcc"), "-cubin", f"-arch={args.arch}", *NVCC_FLAGS,
                            "-I" + os.path.join(ROOT, "csrc", "include"), KERNEL, "-o", cubin], check=True)
        listing = subprocess.run([tool("nvdisasm"), "-g", "-gi", "-c", cubin], check=True, capture_output=True,
                                 text=True).stdout
    functions = parse(listing)
    ins = next(v for k, v in functions.items() if "fp8_adamw_step_kernel" in k)
    cu, h = Source(KERNEL), Source(MATH)
    cold, rules = rules_for(cu, h, args.dtypes, args.group_size)
    path = walk(ins, cold, rules, cu.key("for (; tile < plan.tiles; tile += warps)"),
                cu.key("const LaneSpan span = lane_span(tile, plan, t.cols);"))

    step_tile = cu.find("__device__ __forceinline__ void step_tile(")
    kernel = cu.find("fp8_adamw_step_kernel(const __grid_constant__")
    by_line = collections.Counter()
    for i in path:  # the outermost line of the chain inside step_tile (else the kernel's)
        lines = [l for f, l in i["chain"] if f == cu.name]
        inside = [l for l in lines if step_tile < l < kernel] or lines
        by_line[inside[-1] if inside else 0] += 1
    ops = collections.Counter(opcode(i["text"]).split(".")[0] for i in path)
    if args.by_line:
        for line, n in sorted(by_line.items()):
            print(f"{n:6d}  {line:4d}  {cu.lines[line - 1].strip()[:90] if line else ''}")
    print(f"kernel: {len(ins)} SASS instructions; tile loop hot path: {len(path)} per lane and tile of "
          f"{ELEMENTS_PER_TILE_LANE} elements = {len(path) / ELEMENTS_PER_TILE_LANE:.1f} per element "
          f"({args.dtypes}, G = {args.group_size})")
    print("by opcode: " + " ".join(f"{o}:{n}" for o, n in ops.most_common()))
    local = sum(n for o, n in ops.items() if o in ("LDL", "STL"))
    print(f"local memory instructions on the path: {local}")


if __name__ == "__main__":
    main()
