"""torch's functional all-gathers on gloo with several in flight on one group: does this
torch still corrupt the heap? (why parallel/auto/runtime/schedule.py keeps one in flight
per group on CPU meshes; run it after a torch upgrade to see whether that is still needed)

    python scripts/repro_gloo_gathers.py                  # 6 in flight, 3 runs of 2,000 steps
    python scripts/repro_gloo_gathers.py --in-flight 1    # one at a time: the runtime's schedule

Each of 4 gloo ranks issues `--in-flight` asynchronous all-gathers (random sizes) a step,
allocates some scratch memory, and waits for them in a random order, checking every
gathered value. torch 2.13 (CPU): 6 in flight aborted 3 runs in 3 with "malloc():
unaligned tcache chunk detected"; 1 in flight, 0 in 3. Exit 1 when any run failed.
"""

from __future__ import annotations

import argparse

from tools.bench_common import run_on_ranks


class _Steps:
    def __init__(self, steps: int, in_flight: int):
        self.steps, self.in_flight = steps, in_flight

    def __call__(self) -> int:
        import torch
        import torch.distributed as dist

        from parallel import _torch as T  # torch's functional collectives (private API: the adapter)

        rank, world = dist.get_rank(), dist.get_world_size()
        gen = torch.Generator().manual_seed(0)  # the same sizes on every rank
        for _ in range(self.steps):
            started = []
            for _ in range(self.in_flight):
                n = int(torch.randint(1, 20000, (1,), generator=gen)) * 4
                started.append((T.all_gather_single(torch.full((n,), float(rank + 1)), 0, dist.group.WORLD), n))
            scratch = [torch.randn(int(torch.randint(1, 50000, (1,), generator=gen))) for _ in range(20)]
            for i in torch.randperm(len(started), generator=gen).tolist():
                out, n = started[i]
                got = T.wait_tensor(out).view(world, n)[:, 0]
                if not torch.equal(got, torch.arange(1, world + 1, dtype=got.dtype)):
                    raise RuntimeError(f"wrong all-gather result {got.tolist()}")
            del scratch
        return self.steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in-flight", type=int, default=6)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    failed = 0
    for r in range(args.runs):
        try:
            run_on_ranks(_Steps(args.steps, args.in_flight), 4, timeout=600)
            print(f"run {r + 1}: {args.steps} steps, {args.in_flight} all-gathers in flight: ok", flush=True)
        except RuntimeError as e:
            failed += 1
            print(f"run {r + 1}: failed: {str(e).strip().splitlines()[-1]}", flush=True)
    print(f"{failed} of {args.runs} runs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
