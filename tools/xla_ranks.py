"""Can this torch-xla run several ranks as processes? Each rank joins the xla process group and
all-reduces a tensor holding rank + 1; with N working ranks every one reads N (N + 1) / 2.

    PJRT_DEVICE=CPU torchrun --nproc_per_node 2 -m tools.xla_ranks

Exit 0 where the all-reduce combined the ranks, 1 where it did not (torch-xla 2.9 on its CPU
backend: each process sees one device and a group of one, so every rank reads its own value).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" process group
import torch_xla.runtime as xr


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("xla", init_method="xla://")
    value = torch.full((3,), float(rank + 1), device=torch_xla.device())
    dist.all_reduce(value)
    got, want = value.cpu()[0].item(), world * (world + 1) / 2
    print(f"rank:{rank} torchrun_world:{world} group_size:{dist.get_world_size()} global_devices:"
          f"{xr.global_device_count()} all_reduce:{got:g} expected:{want:g}", flush=True)
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
