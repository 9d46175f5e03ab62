"""Pretrain a HuggingFace Llama with FSDP2 (fully_shard), in BF16 or, with --coat, in FP8 with coat, and save
and resume it with torch.distributed.checkpoint. Run it with torchrun:

    torchrun --nproc_per_node 2 examples/train_fsdp2.py --preset 100m --coat --checkpoint-dir ckpt --save-every 500
    torchrun --nproc_per_node 2 examples/train_fsdp2.py --preset 100m --coat --checkpoint-dir ckpt --resume

--bf16-weights keeps the shards in bfloat16 (no float32 master copy; coat.optim.AdamW rounds each update
stochastically, each shard with the random bits of its elements in the whole tensor),
--fp8-reduce-scatter sends the gradients as block-scaled FP8 (coat.distributed.fp8_reduce_scatter), and
--fp8-all-gather sends the projection weights as FP8 codes (coat.distributed.fp8_all_gather).
NCCL on GPUs, gloo on CPUs (the same script runs on two CPU processes). With coat, the order is: convert,
then shard, then build the optimizer on the sharded parameters:

    coat.convert(model)
    model.to(device); coat.distributed.fp8_all_gather(model)   # --fp8-all-gather: before fully_shard
    for layer in model.model.layers: fully_shard(layer, mp_policy=...)
    fully_shard(model, mp_policy=...)
    optimizer = coat.optim.AdamW(model.parameters(), ...)

Each process trains on its own batches (--batch sequences each; the global batch is --batch x processes).
A checkpoint (CHECKPOINT_DIR/step_N) holds the sharded model, the optimizer's FP8 states, the schedule and
the step; data order is a function of (seed, step, rank), so --resume continues the loss curve exactly
where an uninterrupted run would be. A checkpoint is written as step_N.partial and renamed step_N once every
rank has saved its part: --resume takes the newest step_N and skips a step_N.partial that a killed run left.
The options shared with train_llama.py are described there.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import coat
from training_common import (
    TrainingLog,
    add_training_arguments,
    build_model,
    build_optimizer,
    choose_sdpa_backends,
    convert_gradient_format,
    cosine_schedule,
    held_out_loss,
    load_text,
    parameter_count,
    print_comparison,
    resolve,
    training_step,
    try_plot,
)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--checkpoint-dir", help="where checkpoints go (CHECKPOINT_DIR/step_N) and come from")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--stop-after", type=int, help="leave after this many steps (the schedule still spans --steps)")
    parser.add_argument("--fp8-reduce-scatter", action="store_true",
                        help="reduce-scatter gradients as block-scaled FP8 (coat.distributed.fp8_reduce_scatter): "
                             "1.03 bytes per element on the wire instead of 4")
    parser.add_argument("--fp8-all-gather", action="store_true",
                        help="all-gather the projection weights as FP8 codes (coat.distributed.fp8_all_gather): "
                             "1 byte per element on the wire instead of 2")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: one GPU per process, NCCL; cpu: gloo")
    args = resolve(parser.parse_args())
    if args.fp8_grads:
        raise SystemExit("--fp8-grads needs unsharded parameters (examples/train_llama.py); under FSDP2 use "
                         "--bf16-weights for 2-byte gradients and --fp8-reduce-scatter to send them in FP8")
    for flag, requested in (("--fp8-reduce-scatter", args.fp8_reduce_scatter), ("--fp8-all-gather", args.fp8_all_gather)):
        if requested and not args.coat:
            raise SystemExit(f"{flag} is coat's collective: add --coat")
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        raise SystemExit("--resume and --save-every need --checkpoint-dir")
    if "RANK" not in os.environ:
        raise SystemExit("run this script with torchrun, e.g. torchrun --nproc_per_node 2 examples/train_fsdp2.py")
    if args.device == "cuda" and torch.cuda.device_count() < int(os.environ["LOCAL_WORLD_SIZE"]):
        raise SystemExit(f"{os.environ['LOCAL_WORLD_SIZE']} processes per node need as many GPUs, this node has "
                         f"{torch.cuda.device_count()}: lower --nproc_per_node or pass --device cpu")
    return args


def setup_distributed(device_type: str) -> torch.device:
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def shard(model: torch.nn.Module, device: torch.device, fp8_all_gather: bool) -> None:
    """One FSDP2 unit per decoder layer plus the root (embedding, final norm, LM head). Parameters are
    gathered in bf16, the compute dtype, and gradients reduced in float32: the float32 shards stay the
    master weights (with --bf16-weights the shards are bf16 and so are the reduced gradients). With
    fp8_all_gather the projection weights are gathered as FP8 codes instead (quantized from their bf16 cast)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # An explicit mesh: fully_shard's default one is on the GPUs whenever torch sees any, even with --device cpu.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model.to(device)
    if fp8_all_gather:
        coat.distributed.fp8_all_gather(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


# The suffix of a checkpoint directory while it is being written.
PARTIAL = ".partial"


def mean_over_ranks(value: torch.Tensor) -> float:
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def newest_checkpoint(directory: str) -> tuple[str, int]:
    """The newest complete checkpoint: step_N directories are complete by construction (save_checkpoint);
    a newer step_N.partial, left by a save that did not finish, is skipped with a message."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = [int(m.group(1)) for name in names if (m := re.fullmatch(r"step_(\d+)", name))]
    partial = sorted(int(m.group(1)) for name in names if (m := re.fullmatch(rf"step_(\d+){PARTIAL}", name)))
    if not steps:
        raise SystemExit(f"--resume: no complete step_N checkpoint in {directory}"
                         + (f" (only unfinished saves: step_{partial[-1]}{PARTIAL})" if partial else ""))
    newest = max(steps)
    if dist.get_rank() == 0:
        for step in (step for step in partial if step > newest):
            print(f"--resume: skipping {os.path.join(directory, f'step_{step}{PARTIAL}')}, a save that did not "
                  f"finish; resuming from step_{newest}")
    return os.path.join(directory, f"step_{newest}"), newest


def checkpoint_state(model, optimizer, scheduler, step: int) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": {"step": step, "scheduler": scheduler.state_dict()},
    }


def save_checkpoint(directory: str, model, optimizer, scheduler, step: int) -> None:
    """Saves into step_N.partial and renames it step_N once every rank's save has finished: a process killed
    during the save leaves only the .partial directory, which --resume skips."""
    path = os.path.join(directory, f"step_{step}")
    if dist.get_rank() == 0 and os.path.exists(path + PARTIAL):
        print(f"removing {path + PARTIAL}, left by a save that did not finish")
        shutil.rmtree(path + PARTIAL)
    dist.barrier()
    dcp.save(checkpoint_state(model, optimizer, scheduler, step), checkpoint_id=path + PARTIAL)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(path):  # an earlier run's checkpoint of this step
            shutil.rmtree(path)
        os.rename(path + PARTIAL, path)
    dist.barrier()


def load_checkpoint(directory: str, model, optimizer, scheduler) -> int:
    path, step = newest_checkpoint(directory)
    state = checkpoint_state(model, optimizer, scheduler, step)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["train"]["scheduler"])
    if state["train"]["step"] != step:
        raise SystemExit(f"{path} holds step {state['train']['step']}, its name says {step}: the directory is damaged")
    return step


def main() -> None:
    args = parse_arguments()
    device = setup_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    choose_sdpa_backends(args.sdpa_backends, device)
    model, tokenizer = build_model(args, "cpu")  # the same float32 weights on every rank, from --seed
    parameters = parameter_count(model)
    if args.bf16_weights:
        model.to(torch.bfloat16)  # no float32 master copy: coat.optim.AdamW updates the bf16 shards themselves
    if args.coat:
        if args.saved_format == "auto":
            raise SystemExit("--saved-format auto is train_llama.py's (it captures a report step): use e4m3, fp6 or fp4")
        coat.convert(model, saved_format=args.saved_format, fast_accum=args.fast_accum, group_size=args.group_size,
                     fused_loss=not args.unfused_loss, gradient_format=convert_gradient_format(args),
                     skip_modules=args.bf16_modules)
    shard(model, device, args.fp8_all_gather)
    if args.fp8_reduce_scatter:
        coat.distributed.fp8_reduce_scatter(model)
    optimizer = build_optimizer(args, model)
    scheduler = cosine_schedule(optimizer, args.warmup, args.steps)
    first_step = load_checkpoint(args.checkpoint_dir, model, optimizer, scheduler) if args.resume else 0
    last_step = min(args.steps, args.stop_after or args.steps)
    data = load_text(args, tokenizer)
    validation = data.validation_batches(args.eval_batches, args.batch, rank)
    if rank == 0:
        print(f"{args.name}: {parameters / 1e6:.1f}M parameters, {'coat FP8' if args.coat else 'BF16'}, FSDP2 on "
              f"{world} x {device.type}, steps {first_step}..{last_step} of {args.steps}, global batch "
              f"{world} x {args.batch} x {args.seq} tokens")

    autocast = contextlib.nullcontext  # FSDP2's mixed-precision policy casts instead
    setup = {"coat": args.coat, "bf16_weights": args.bf16_weights, "param_rounding": args.param_rounding,
             "fp8_reduce_scatter": args.fp8_reduce_scatter, "fp8_all_gather": args.fp8_all_gather,
             "gradient_format": args.gradient_format if args.coat else None, "torch_adamw": args.torch_adamw,
             "bf16_modules": args.bf16_modules,
             "sdpa_backends": args.sdpa_backends, "lr": args.lr, "warmup": args.warmup,
             "preset": None if args.model else args.preset, "family": args.family, "fused_loss": args.coat and not args.unfused_loss, "parameters": parameters,
             "world_size": world, "batch_per_rank": args.batch, "seq": args.seq}
    log = TrainingLog(args, first_step, world * args.batch * args.seq, device, setup, enabled=rank == 0)
    interval_loss = torch.zeros((), device=device)
    model.train()
    for step in range(first_step, last_step):
        batch = data.train_batch(step, args.batch, rank).to(device, non_blocking=True)
        interval_loss += training_step(model, optimizer, scheduler, batch, args.clip, autocast)
        log.step_done()
        done = step + 1
        if done % args.log_every == 0 or done == last_step:
            intervals = done - max(first_step, (done - 1) // args.log_every * args.log_every)
            train_loss = mean_over_ranks(interval_loss / intervals)
            interval_loss.zero_()
            evaluate = done % args.eval_every == 0 or done == args.steps
            log.record(done, train_loss, scheduler.get_last_lr()[0],
                       (lambda: mean_over_ranks(held_out_loss(model, validation, device, autocast))) if evaluate else None)
        if args.checkpoint_dir and ((args.save_every and done % args.save_every == 0) or done == last_step):
            save_checkpoint(args.checkpoint_dir, model, optimizer, scheduler, done)

    summary = log.finish()
    if rank == 0 and summary.get("final_train_loss_last_10pct") is not None:
        print(f"{args.name}: training loss (last 10%) {summary['final_train_loss_last_10pct']:.4f}"
              + (f", held-out {summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else "")
              + f", {summary['median_tokens_per_s']:,.0f} tokens/s over {world} processes")
        compared = [path for path in args.compare if path != log.csv_path]
        print_comparison(compared, log.csv_path)
        try_plot(compared + [log.csv_path], log.csv_path[:-4] + ".png")
    # Every rank waits for rank 0's plot: a rank that tears gloo down while a peer is still connected can abort
    # at exit ("terminate called without an active exception", seen on torch 2.13 CPU).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # With everything written and the process group destroyed, leave without the interpreter's teardown: there
    # gloo's threads still abort a rank now and then on torch 2.13 CPU ("terminate called without an active
    # exception", seen in CI after the barrier above), failing a run that finished. An error in main() still
    # raises before this line and exits nonzero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
