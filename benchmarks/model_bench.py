"""Forward+backward speed of the tiny Qwen3-MoE: Megatron-core GPTModel vs transformers, same batch.

    python -m benchmarks.model_bench            # Megatron EP=1 in this process
    python -m benchmarks.model_bench --ep 2     # Megatron EP=2: relaunches itself under torchrun
    python -m benchmarks.model_bench --compile  # also Megatron's decoder under torch.compile (EP=1)

Loss: mean logsumexp of the logits (a stand-in with a full backward through every layer). fp32.
With `--ep 2` the two ranks split the batch (each runs B/2 rows, the allgather dispatcher sends
tokens to both ranks' experts) and the reported time is the slower rank's time per global batch;
each rank gets `threads // 2` threads so the comparison with transformers (all threads) uses the
same cores. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch


def _time_fwd_bwd(step, iters: int, warmup: int) -> float:
    """Median milliseconds of `step()` over `iters` runs after `warmup` runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _batch(args, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))


def bench_transformers(args) -> float:
    from moe_gspo.tiny import build_tiny_model

    hf = build_tiny_model(seed=0).train()
    ids = _batch(args, hf.config.vocab_size)

    def step():
        hf.zero_grad(set_to_none=True)
        hf(ids).logits.logsumexp(-1).mean().backward()

    return _time_fwd_bwd(step, args.iters, args.warmup)


def bench_megatron(args, *, ep_size: int, compile_decoder: bool = False) -> float:
    import torch.distributed as dist

    from moe_gspo.mcore.model import build_gpt_model, forward_logits
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.mcore.weights import load_hf_model_into_megatron
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config()
    info = init_distributed(ep_size=ep_size, num_experts=cfg.num_experts, seed=0)
    model = build_gpt_model(cfg, ep_size=ep_size)
    load_hf_model_into_megatron(model, build_tiny_model(cfg, seed=0))
    model.train()
    ids = _batch(args, cfg.vocab_size)
    rows = args.batch // info.world_size
    ids = ids[info.rank * rows:(info.rank + 1) * rows]

    def step():
        model.zero_grad(set_to_none=True)
        forward_logits(model, ids).logsumexp(-1).mean().backward()

    if compile_decoder:  # the transformer layers compiled; the first call's compile time is printed
        model.decoder = torch.compile(model.decoder)
        t0 = time.perf_counter()
        step()
        print(f"  torch.compile: first forward+backward {time.perf_counter() - t0:.1f} s (compiling)")
        breaks = torch._dynamo.utils.counters.get("graph_break", {})
        print(f"  torch.compile: {sum(breaks.values())} graph breaks of {len(breaks)} kinds"
              + "".join(f"\n    {n} x {str(reason).splitlines()[0][:100]}" for reason, n in breaks.items()))
    ms = _time_fwd_bwd(step, args.iters, args.warmup)
    if info.world_size > 1:
        t = torch.tensor([ms])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t)
    destroy_distributed()
    return ms


def _run_ep2(args) -> float:
    threads = max(1, torch.get_num_threads() // 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ep2.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "benchmarks.model_bench", "--worker-out", str(out), "--ep", "2",
               "--batch", str(args.batch), "--seq", str(args.seq), "--iters", str(args.iters),
               "--warmup", str(args.warmup)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"EP=2 benchmark failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["ms"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, choices=(1, 2), default=1, help="Megatron expert-parallel size")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="also time Megatron EP=1 with its decoder under torch.compile")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.compile and args.ep != 1:
        parser.error("--compile times EP=1 only")
    if args.batch % args.ep != 0:
        parser.error(f"--batch={args.batch} must be divisible by --ep={args.ep}")

    if args.worker_out is not None:  # a torchrun child of `--ep 2`
        ms = bench_megatron(args, ep_size=args.ep)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.worker_out).write_text(json.dumps({"ms": ms}))
        return

    hf_ms = bench_transformers(args)
    mc_ms = bench_megatron(args, ep_size=1) if args.ep == 1 else _run_ep2(args)
    print(f"tiny Qwen3-MoE forward+backward, batch {args.batch}x{args.seq}, fp32, CPU, "
          f"{torch.get_num_threads()} threads, median of {args.iters}")
    print(f"  transformers           {hf_ms:8.1f} ms/iter")
    print(f"  megatron-core EP={args.ep}      {mc_ms:8.1f} ms/iter")
    print(f"  ratio megatron/transformers  {mc_ms / hf_ms:.2f}")
    if args.compile:
        ms = bench_megatron(args, ep_size=1, compile_decoder=True)
        print(f"  megatron-core EP=1, decoder under torch.compile {ms:8.1f} ms/iter")


if __name__ == "__main__":
    main()
