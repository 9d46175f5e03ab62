"""The local kernels of coat's FP8 collectives (coat.distributed) on one GPU, without torch.distributed, against
a device copy of the same bytes timed in the same run.

Per decoder layer of a Llama-2-7B shape (hidden 4096, intermediate 11008) sharded over W ranks by FSDP2:

  reduce-scatter (FP8ReduceScatter), the layer's flat float32 gradient buffer, n elements:
    quantize             W chunks to E4M3 in 1 x 128 blocks (FP8ReduceScatter.quantize)
                         least bytes: 4n read, n + 4n/128 written
    dequantize + sum     the W received chunks to float32, summed and averaged (FP8ReduceScatter.reduce)
                         least bytes: n + 4n/128 read, 4n/W written
    float32 sum          the W chunks of a float32 buffer summed, the local work of a float32 reduce-scatter
                         that reduces on the receiver (context)
  all-gather (fp8_all_gather), this rank's bf16 shards of the layer's 7 projection weights, m elements:
    amaxes               the local amax of each of the 4 scale groups, stacked (what one all-reduce agrees)
                         least bytes: 2m read
    quantize shards      each shard to E4M3 under its group's amax, padded (coat.distributed.quantize_shard)
                         least bytes: 2m read, m written
    post-all-gather      the gathered codes of the 7 weights wrapped as FP8Weight (views: no kernel; the host
                         time of the calls)
  copy                   a device copy of the float32 buffer (read + write counted), and of the bf16 shards: the
                         copy-in a bf16 all-gather makes of them; "vs copy" divides each op's GB/s by its copy's

GB/s counts the least bytes above; "ms" is the median of CUDA-event times after warm-up
(_common.time_ms); the post-all-gather row is the host's time per call of the 7 wraps.

    python benchmarks/fp8_collectives.py                     (needs a CUDA GPU)
    python benchmarks/fp8_collectives.py --world-sizes 2 8
    python benchmarks/fp8_collectives.py --smoke             (tiny shapes on the CPU: checks that the script runs)
"""
import sys

import torch

import coat
from coat import ops
from coat.distributed import FP8ReduceScatter, quantize_shard
from coat.nn.fp8_weight import FP8Weight

from _common import host_us_per_call, parser, print_table, time_ms, write_results

SHAPE = (4096, 11008)  # Llama-2-7B: hidden, intermediate
SMOKE_SHAPE = (64, 128)


def layer_weights(hidden: int, intermediate: int) -> list[list[tuple[int, int]]]:
    """The projection weights' shapes of one decoder layer, by scale group: q/k/v, o, gate/up, down."""
    return [[(hidden, hidden)] * 3, [(hidden, hidden)], [(intermediate, hidden)] * 2, [(hidden, intermediate)]]


def measure(shape, world_size: int, device: str, warmup: int, repeat: int) -> list[dict]:
    groups = layer_weights(*shape)
    # FSDP2's dim-0 shards: ceil(rows / W) rows each (the last ranks' padded)
    shards = [[torch.randn(-(-rows // world_size), cols, device=device, dtype=torch.bfloat16) for rows, cols in group]
              for group in groups]
    flat_shards = [shard for group in shards for shard in group]
    m = sum(shard.numel() for shard in flat_shards)
    # The gradient buffer FSDP2 reduce-scatters: every rank's shards of the layer, float32 (reduce dtype)
    n = world_size * m
    buffer = torch.randn(n, device=device)
    comm = FP8ReduceScatter()
    codes, scales = comm.quantize(buffer, world_size)
    output = torch.empty(n // world_size, device=device)
    amaxes = torch.stack([ops.tensor_amax(group) for group in shards])
    amax_of = [amax for group, amax in zip(shards, amaxes) for _ in group]
    gathered = [torch.zeros(world_size * shard.shape[0], shard.shape[1], device=device, dtype=torch.uint8)
                for shard in flat_shards]
    buffer_copy, shard_copy = torch.empty_like(buffer), [torch.empty_like(s) for s in flat_shards]

    def quantize_shards():
        for shard, amax in zip(flat_shards, amax_of):
            quantize_shard(shard, amax, torch.float8_e4m3fn, shard.shape[0])

    def post_all_gather():
        for codes_of_weight, shard in zip(gathered, flat_shards):
            FP8Weight(codes_of_weight[: world_size * shard.shape[0]].view(torch.float8_e4m3fn), amaxes[0], amaxes[0],
                      torch.bfloat16)

    block_bytes = n + 4 * n // comm.block_size
    cases = {  # name -> (callable, least bytes, the copy it is compared with)
        "reduce-scatter: copy of the float32 buffer": (lambda: buffer_copy.copy_(buffer), 8 * n, None),
        "reduce-scatter: quantize": (lambda: comm.quantize(buffer, world_size), 4 * n + block_bytes, "buffer"),
        "reduce-scatter: dequantize + sum": (lambda: comm.reduce(codes, scales, output, average=True),
                                             block_bytes + 4 * n // world_size, "buffer"),
        "reduce-scatter: float32 sum (context)": (lambda: torch.sum(buffer.view(world_size, -1), dim=0, out=output),
                                                  4 * n + 4 * n // world_size, "buffer"),
        "all-gather: copy of the bf16 shards": (lambda: torch._foreach_copy_(shard_copy, flat_shards), 4 * m, None),
        "all-gather: amaxes": (lambda: torch.stack([ops.tensor_amax(group) for group in shards]), 2 * m, "shards"),
        "all-gather: quantize shards": (quantize_shards, 3 * m, "shards"),
    }
    timed = {name: (time_ms(fn, warmup, repeat, device), nbytes, copy) for name, (fn, nbytes, copy) in cases.items()}
    copy_gbs = {"buffer": 8 * n / timed["reduce-scatter: copy of the float32 buffer"][0] / 1e6,
                "shards": 4 * m / timed["all-gather: copy of the bf16 shards"][0] / 1e6}
    rows = []
    for name, (ms, nbytes, copy) in timed.items():
        gbs = nbytes / ms / 1e6
        rows.append({"world size": world_size, "op": name, "elements": n if name.startswith("reduce") else m,
                     "ms": ms, "GB/s": gbs, "vs copy": gbs / copy_gbs[copy] if copy else 1.0})
    rows.append({"world size": world_size, "op": "all-gather: post-all-gather (host)", "elements": m,
                 "ms": host_us_per_call(post_all_gather, 10 if device == "cpu" else 200, max(repeat // 10, 1), device) / 1e3})
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8], help="FSDP2 ranks the layer is sharded over")
    p.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU, one run each")
    args = p.parse_args()
    if args.smoke:
        device, shape, args.warmup, args.repeat, args.world_sizes = "cpu", SMOKE_SHAPE, 1, 1, [2]
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/fp8_collectives.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, shape = "cuda", SHAPE
    torch.manual_seed(0)
    rows = [row for world_size in args.world_sizes for row in measure(shape, world_size, device, args.warmup, args.repeat)]
    print_table(rows, ["world size", "op", "elements", "ms", "GB/s", "vs copy"])
    summary = {"smoke": args.smoke, "shape": {"hidden": shape[0], "intermediate": shape[1]},
               "vs_copy": {f"{row['op']} (W={row['world size']})": row["vs copy"] for row in rows if "vs copy" in row}}
    path = write_results(args.results_dir, "fp8-collectives-smoke" if args.smoke else "fp8-collectives", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
