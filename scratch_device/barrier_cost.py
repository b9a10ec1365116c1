"""How much does one grid barrier of the layer kernel cost, against a kernel boundary in a CUDA graph? (H100)"""
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.triton_layer import _grid_sync  # noqa: E402
from tools.profile_step import graph_ms  # noqa: E402


@triton.jit
def _barriers(sync_ptr, out_ptr, n, WORK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros((128,), dtype=tl.float32)
    offs = tl.arange(0, 128)
    for i in range(n):
        if WORK:  # a store and a load of another program's line between barriers (the phases' data flow)
            tl.store(out_ptr + pid * 128 + offs, acc + i)
        _grid_sync(sync_ptr, (i + 1) * nprog, True)
        if WORK:
            acc += tl.load(out_ptr + ((pid + 1) % nprog) * 128 + offs, cache_modifier=".cg")
    tl.store(out_ptr + pid * 128 + offs, acc)
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _step(in_ptr, out_ptr):
    pid = tl.program_id(0)
    offs = tl.arange(0, 128)
    x = tl.load(in_ptr + ((pid + 1) % tl.num_programs(0)) * 128 + offs)
    tl.store(out_ptr + pid * 128 + offs, x + 1)


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sync = torch.zeros(2, dtype=torch.int32, device=dev)
    n = 84  # 12 layers x 7 barriers
    res = {"device": torch.cuda.get_device_name(dev), "sms": sms, "n": n}
    for per_sm in (1, 2):
        grid = sms * per_sm
        buf = torch.zeros(grid * 128, device=dev)
        for work in (0, 1):
            t0 = graph_ms(lambda g=grid, b=buf, w=work: _barriers[(g,)](sync, b, 0, WORK=w, num_warps=4), reps=50)
            t1 = graph_ms(lambda g=grid, b=buf, w=work: _barriers[(g,)](sync, b, n, WORK=w, num_warps=4), reps=50)
            res[f"barrier_us_{per_sm}per_sm_work{work}"] = round(1000 * (t1 - t0) / n, 3)
            res[f"launch_us_{per_sm}per_sm_work{work}"] = round(1000 * t0, 3)
        a, b = torch.zeros(grid * 128, device=dev), torch.zeros(grid * 128, device=dev)

        def chain(g=grid, a=a, b=b) -> None:
            for i in range(n):
                _step[(g,)](a if i % 2 == 0 else b, b if i % 2 == 0 else a, num_warps=4)
        res[f"boundary_us_{per_sm}per_sm"] = round(1000 * graph_ms(chain, reps=20) / n, 3)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
