"""Instructions per element of fp8_adamw_step_kernel's hot path, counted in its SASS (no GPU needed).

The kernel is a persistent loop over 512-column tiles, 16 elements per lane. This script compiles
csrc/cuda/adamw_step.cu with the build's nvcc flags (or takes a cubin), disassembles it with line information
(nvdisasm -g -gi), and walks the tile loop's control flow from its header to its back-edge, choosing at each
conditional branch the direction a typical tile takes: every group expanded (k != 1) with normal values, no
zero / non-finite / subnormal element, a whole tile of an aligned tensor, the fast variants of decode, range and
encode. A tile that starts a decoder batch also computes the batch's decoders: the walk is done for such a tile
and for another, and the count is their average over a batch (4 tiles at G = 128, 2 at 64, 1 below).
Branches are decided by the source line they come from (rules below, written against the source text, so a
change of the kernel may need a change of a rule: the walk stops and prints the branch it cannot decide).
Counts are dynamic for that path: each executed SASS instruction once, including branches, BSSY/BSYNC and
the uniform-datapath instructions; divided by the 16 elements of a lane.

  python tools/sass_hot_path.py                      # fp32 param and grad, G = 128
  python tools/sass_hot_path.py --dtypes bf16 --group-size 16 --formats e4m3-e5m2 --by-line
  python tools/sass_hot_path.py --cubin x.o          # an object of adamw_step.cu (nvcc -c with nvcc.flags)

Needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm puts one in site-packages/nvidia/cu13/bin), and for an
object cuobjdump (nvidia-cuda-cuobjdump), which extracts its cubin. No GPU and no built extension. The walk reads
the line table (nvdisasm -g -gi of a -lineinfo build): a `cuobjdump -sass` listing has none and cannot be used.
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
KERNEL = os.path.join(ROOT, "csrc", "cuda", "adamw_step.cu")
MATH = os.path.join(ROOT, "csrc", "include", "coat", "detail", "adamw_math.h")
# the build's flags (-lineinfo among them: the walk reads the line table)
NVCC_FLAGS = open(os.path.join(ROOT, "csrc", "cuda", "nvcc.flags")).read().split()
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
        return self.key_of(self.find(snippet, after))

    def key_of(self, number: int) -> str:
        return f"{self.name}:{number}"


def rules_for(cu: Source, h: Source, dtypes: str, group_size: int, formats: str, first_in_batch: bool):
    """(cold source lines, branch rules): the hot path of a typical tile, the first of its decoder batch (which
    computes the batch's decoders) or another."""
    cold: set[str] = set()

    def cold_lines(first: str, count: int = 1, last: str | None = None, after: int = 0):
        a = cu.find(first, after)
        b = cu.find(last, a - 1) if last else a + count - 1
        cold.update(f"{cu.name}:{n}" for n in range(a, b + 1))

    # element-by-element I/O and the general variants of decode, ranges and encode
    cold_lines("load_values_scalar(t.param, t.param_dtype", 4)
    cold_lines("step_tile<false>(launch, i, tile, warps, slot);")
    cold_lines("if (first_index + i >= count) continue;", 5)
    cold_lines("store_codes_scalar(t.exp_avg, span.first", 2)
    cold_lines("decode_and_update<true, kVector>(m_codes, v_codes")
    cold_lines("if (specials) ranges = group_ranges(lane_ranges_exact(m, v)")
    cold_lines("m_out = encode<true, true>(m, m_enc", 2)
    # the dtypes not in use
    if dtypes == "fp32":  # fp32 parameters are staged in shared memory and stored by the warp
        cold_lines("const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>",
                   last="out[8 * q + 2 * i + 1] = widen(")
        cold_lines("} else if (kVector) {", last="out[q] = make_uint2(bits[2 * q], bits[2 * q + 1]);",
                   after=cu.find("__device__ __forceinline__ void store_params_chunk("))
    else:  # bf16 parameters are stored by each lane, 4 elements at a time
        cold_lines("const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(data) + first);",
                   last="out[4 * q] = a.x; out[4 * q + 1] = a.y;")
        cold_lines("float4* out = reinterpret_cast<float4*>(static_cast<float*>(t.param) + base);", 3)
        cold_lines("step_param_stage[threadIdx.x / kWarpSize][stage_slot(lane_id(), chunk)] = make_float4(")
        cold_lines("const int warp = threadIdx.x / kWarpSize;", last="__syncwarp();  // read before the next tile",
                   after=cu.find("__device__ __forceinline__ void store_staged_params("))
    split = group_size >= 32
    if split:
        cold_lines("coat_meta m_meta, v_meta;", 7)
    else:
        cold_lines("coat_meta meta;", 7)

    meta = h.find("COAT_INLINE coat_decoder coat_decoder_make")
    new_meta = cu.find("__device__ __forceinline__ LaneEncoder encoder_of_range(")
    tile = cu.find("__device__ __forceinline__ void step_tile(")
    loads = cu.find("if (kVector) {", tile)
    code_store = cu.find("if (kVector) {", cu.find("Codes m_out, v_out;"))
    update = cu.find("__device__ __forceinline__ void decode_and_update(")
    stage = cu.key("stage_params_chunk(chunk / kStoreChunk, updated);", update)
    chunk_store = cu.key("store_params_chunk<kVector>(t, s.options.stochastic_rounding != 0", update)
    uint2_store = cu.key("out[q] = make_uint2(bits[2 * q], bits[2 * q + 1]);")
    staged_store = cu.key("reinterpret_cast<float4*>(tile_params)[j] = step_param_stage[warp]")
    rules = {
        # whole lanes of an aligned tensor
        f"{cu.name}:{loads}": "to:" + cu.key("load_values_vector(t.param, t.param_dtype, span.first, p);"),
        cu.key("if (plan.vector && full)"): "to:" + cu.key("step_tile<true>(launch, i, tile, warps, slot);"),
        # the new parameters: fp32 staged for the warp's store, bf16 stored by the lane (round to nearest)
        cu.key("if (kVector && t.param_dtype == COAT_FLOAT32)", update):
            "to:" + (stage if dtypes == "fp32" else chunk_store),
        cu.key("if (kVector && t.param_dtype == COAT_FLOAT32) {"): "to:" + uint2_store,
        cu.key("bits[i / 2] = stochastic ? param_bf16_bits("):  # its F2FP is shared with the general copy
            "!away:" + cu.key("return stochastic ? coat_f32_to_bf16_stochastic(p, coat_rounding_bits(seed, index))"),
        # (bf16: on to the next tile, whose code the compiler shares with the general copy)
        cu.key("if (t.param_dtype == COAT_FLOAT32) store_staged_params("):
            "to:" + staged_store if dtypes == "fp32" else "!to:" + cu.key("for (int slot = 0; tile < plan.tiles;"),
        f"{cu.name}:{code_store}": "to:" + cu.key("store_codes_vector(t.exp_avg, span.first, m_out);"),
        # the group's values and meta: expanded (k != 1), normal numbers
        cu.key("if (d.linear) {"): "to:" + cu.key("r.head = beta * power_of_2(head_exponent(d.exponent));"),
        cu.key("if (expand && r.amax > 0.0f) {", new_meta): "fallthrough",
        cu.key("if (mean >= COAT_MIN_SCALE && mean <= coat_bf16_max()) {", new_meta): "fallthrough",
        cu.key("if (log2_range > 0.0f)", new_meta): "fallthrough",
        cu.key("if (m.k == 1.0f) {", new_meta): "to:" + cu.key("const float log2_ratio = static_cast<float>(high.exponent", new_meta),
        cu.key("if (m.k == 1.0f) {", cu.find("LaneEncoder e;", new_meta)): "to:" + cu.key("exponent = lc.exponent;", new_meta),
        cu.key("if (subnormal) a = __float_as_uint(x * 16777216.0f);"): "taken",
        cu.key("if (valid) m = coat_meta_load(meta);"): "fallthrough",
        # the butterfly's steps at distances 2 and 4 merge when they stay inside the group
        cu.key("if (offset < layout.lanes_per_group) mine = merge_from(mine, offset);"):
            "seq:" + ",".join("fallthrough" if offset < group_size // 16 else "taken" for offset in (2, 4)),
        cu.key("if (!layout.split) return lane;"): "taken" if split else "fallthrough",
        cu.key("if (slot == 0) compute_decoder_batch("): "to:" + cu.key("for (int round = 0; round < batch.jobs_per_lane;")
            if first_in_batch else "away:" + cu.key("for (int round = 0; round < batch.jobs_per_lane;"),
        # one job per lane, two with G = 16
        cu.key("for (int round = 0; round < batch.jobs_per_lane; ++round) {"):
            "seq:" + ",".join(["to:" + cu.key("const int group = (job & ((1 << batch.job_shift) - 1)) >> 1;")] *
                              (2 if group_size == 16 else 1) +
                              ["away:" + cu.key("const int group = (job & ((1 << batch.job_shift) - 1)) >> 1;")]),
        cu.key("if (layout.split) {", cu.find("LaneEncoder m_enc, v_enc;")):
            "to:" + cu.key("const LaneEncoder mine = encoder_of_range(" if split else "m_enc = encoder_of_range(ranges.m"),
        # some lanes of the warp store the new meta: the warp runs the stores
        cu.key("if (group_valid && (lane & (layout.lanes_per_group - 1)) < 2) coat_meta_store(meta, own_meta);"):
            "fallthrough",
        cu.key("if (group_valid) {", cu.find("coat_meta m_meta, v_meta;")): "fallthrough",
        # the encoders of m and v, in this order, by their formats
        cu.key("return format == COAT_E4M3 ? encode_state<COAT_E4M3, kGeneral, kSigned>(x, e)"): "seq:" + ",".join(
            ("away:" if f == "e4m3" else "to:") + cu.key(": encode_state<COAT_E5M2, kGeneral, kSigned>(x, e);")
            for f in formats.split("-")),
    }
    return cold, rules


def walk(ins: list[dict], cold: set[str], rules: dict[str, str], loop_line: str, header_line: str,
         within: str | None = None):
    """The hot path of one iteration of the loop whose back-edge comes from source line loop_line and whose
    body holds header_line (both "file:line"), in the copy of it inlined at `within` when the code holds several:
    every instruction from the loop's head to its back-edge, conditional branches decided by `rules` (source
    line -> "taken", "fallthrough", "to:LINE|LINE" toward the nearer of those lines, "into:LINE|LINE" toward
    more instructions from those lines (of the next 60, up to the branch's own line), "away:LINE|LINE" toward
    fewer, "text:TEXT" toward the nearer instruction holding TEXT, or "seq:DIR,DIR,..." one per visit) after
    two defaults: away from a block that calls a slow path, away from a block whose instructions mostly come
    from `cold` lines. A rule written "!RULE" comes before the defaults: for a branch to code that the compiler
    shares with a cold copy, whose instructions then carry the cold copy's lines."""
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
        c = next((c for c in chain(i) if c in rules), None)
        if c is None or not rules[c].startswith("!"):
            if slow(taken) != slow(fallthrough):
                return fallthrough if slow(taken) else taken
            if mostly_cold(taken) != mostly_cold(fallthrough):
                return fallthrough if mostly_cold(taken) else taken
        if c is None:
            raise RuntimeError(f"no rule for the branch at {i['addr']:#x} {i['text']} ({' <- '.join(chain(i)[:4])})")
        rule = rules[c].removeprefix("!")
        if rule.startswith(("to:", "into:", "away:", "text:")):
            if rule.startswith("to:"):
                wanted = rule[3:].split("|")
                dt, df = distance(taken, wanted), distance(fallthrough, wanted)
            elif rule.startswith("into:"):  # more instructions from the lines
                wanted = rule[5:].split("|")
                dt, df = -share(taken, wanted, c), -share(fallthrough, wanted, c)
            elif rule.startswith("away:"):  # fewer instructions from the lines
                wanted = rule[5:].split("|")
                dt, df = share(taken, wanted, c), share(fallthrough, wanted, c)
            else:
                dt, df = text_distance(taken, rule[5:]), text_distance(fallthrough, rule[5:])
            if dt == df:
                raise RuntimeError(f"rule {c}={rule} does not separate the branch at {i['addr']:#x}")
            return taken if dt < df else fallthrough
        if rule.startswith("seq:"):  # one direction per visit of this branch, in order
            directions = rule[4:].split(",")
            rule = directions[min(visits[c], len(directions) - 1)]
            visits[c] += 1
        if rule.startswith(("to:", "away:")):  # the direction nearer to (farther from) a source line
            wanted = rule.split(":", 1)[1].split("|")
            dt, df = distance(taken, wanted), distance(fallthrough, wanted)
            if dt == df:
                raise RuntimeError(f"rule {c}={rule} does not separate the branch at {i['addr']:#x}")
            return taken if (dt < df) == rule.startswith("to:") else fallthrough
        return taken if rule == "taken" else fallthrough

    # the back-edge: a conditional branch of loop_line to an earlier instruction, with header_line in between
    # (the widest such loop)
    backedge = header = None
    for k, i in enumerate(ins):
        if opcode(i["text"]) == "BRA" and i["text"].startswith("@") and loop_line in chain(i) and (
                within is None or within in chain(i)):
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
    package = {"nvdisasm": " (pip install nvidia-cuda-nvdisasm)", "cuobjdump": " (pip install nvidia-cuda-cuobjdump)"}
    sys.exit(f"{name} not found (on PATH or in site-packages/nvidia/cu*/bin){package.get(name, '')}")


ELF_MACHINE_CUDA = 190  # e_machine of a cubin; a host object (nvcc -c) or executable holds cubins in its fatbin


def cubin_of(path: str, arch: str, tmp: str) -> str:
    """The cubin to disassemble: `path` itself when it is one, else the `arch` cubin that cuobjdump extracts from
    the object or executable at `path`."""
    with open(path, "rb") as f:
        header = f.read(20)
    if header[:4] != b"\x7fELF":
        sys.exit(f"{path} is neither a cubin nor an object file: pass the cubin or the object (nvcc -c) itself; a "
                 "`cuobjdump -sass` listing has no line information, which the walk needs")
    if int.from_bytes(header[18:20], "little") == ELF_MACHINE_CUDA:
        return path
    subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(path)], check=True, cwd=tmp,
                   capture_output=True)
    found = sorted(name for name in os.listdir(tmp) if name.endswith(f".{arch}.cubin"))
    if not found:
        sys.exit(f"{path} holds no {arch} cubin (compile it with -arch={arch}, or pass --arch)")
    return os.path.join(tmp, found[0])


def disassemble(cubin: str) -> str:
    """nvdisasm's listing of `cubin` with its line table (-g -gi), which the walk needs."""
    listing = subprocess.run([tool("nvdisasm"), "-g", "-gi", "-c", cubin], check=True, capture_output=True,
                             text=True).stdout
    if not LINE.search(listing):
        sys.exit(f"{cubin} has no line information: compile it with -lineinfo (csrc/cuda/nvcc.flags has it)")
    return listing


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cubin", help="a cubin of csrc/cuda/adamw_step.cu, or an object compiled from it with "
                        "nvcc -c (default: compile one)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dtypes", choices=["fp32", "bf16"], default="fp32",
                        help="param and grad dtype (fp32 / fp32 or bf16 / bf16)")
    parser.add_argument("--group-size", type=int, choices=[16, 32, 64, 128], default=128)
    parser.add_argument("--formats", choices=["e4m3-e4m3", "e4m3-e5m2"], default="e4m3-e4m3",
                        help="FP8 formats of m and v (they pick the encode loops)")
    parser.add_argument("--by-line", action="store_true", help="instructions per source line of step_tile")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.cubin is None:
            cubin = os.path.join(tmp, "adamw_step.cubin")
            subprocess.run([tool("nvcc"), "-cubin", f"-arch={args.arch}", *NVCC_FLAGS,
                            "-I" + os.path.join(ROOT, "csrc", "include"), KERNEL, "-o", cubin], check=True)
        else:
            cubin = cubin_of(args.cubin, args.arch, tmp)
        functions = parse(disassemble(cubin))
    ins = next((v for k, v in functions.items() if "fp8_adamw_step_kernel" in k), None)
    if ins is None:
        sys.exit(f"no fp8_adamw_step_kernel in {args.cubin}: pass a cubin or object of csrc/cuda/adamw_step.cu")
    cu, h = Source(KERNEL), Source(MATH)
    batch_tiles = max(args.group_size // 32, 1)  # tiles per decoder batch (csrc/cuda/adamw_step.cu, DecoderBatch)
    loop_line = cu.key("for (int slot = 0; tile < plan.tiles; tile += warps")
    header_line = cu.key("const LaneSpan span = lane_span(tile, plan, t.cols);")
    paths = [walk(ins, *rules_for(cu, h, args.dtypes, args.group_size, args.formats, first), loop_line, header_line)
             for first in (True, False)]
    path = paths[0] + paths[1] * (batch_tiles - 1)

    step_tile = cu.find("__device__ __forceinline__ void step_tile(")
    kernel = cu.find("fp8_adamw_step_kernel(const __grid_constant__")
    by_line = collections.Counter()
    for i in path:  # the outermost line of the chain inside step_tile (else the kernel's), summed over a batch
        lines = [l for f, l in i["chain"] if f == cu.name]
        inside = [l for l in lines if step_tile < l < kernel] or lines
        by_line[inside[-1] if inside else 0] += 1
    ops = collections.Counter(opcode(i["text"]).split(".")[0] for i in path)
    if args.by_line:
        for line, n in sorted(by_line.items()):
            print(f"{n / batch_tiles:6.1f}  {line:4d}  {cu.lines[line - 1].strip()[:90] if line else ''}")
    per_tile = len(path) / batch_tiles
    print(f"kernel: {len(ins)} SASS instructions; tile loop hot path: {len(paths[0])} for the first tile of a decoder "
          f"batch of {batch_tiles}, {len(paths[1])} for the others: {per_tile:.0f} per lane and tile of "
          f"{ELEMENTS_PER_TILE_LANE} elements = {per_tile / ELEMENTS_PER_TILE_LANE:.1f} per element "
          f"({args.dtypes}, G = {args.group_size})")
    print("by opcode: " + " ".join(f"{o}:{n}" for o, n in ops.most_common()))
    local = sum(n for o, n in ops.items() if o in ("LDL", "STL"))
    print(f"local memory instructions on the path: {local}")


if __name__ == "__main__":
    main()
