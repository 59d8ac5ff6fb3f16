"""Small target programs for launcher tests, written into a temporary folder."""

from __future__ import annotations

from pathlib import Path

#: Writes its argv, launch variables and pid to OUT/rank<RANK>.json; then behaves as told by --mode.
RECORD = """
import json, os, signal, subprocess, sys, time
out = os.environ["TEST_OUT"]
rank = os.environ.get("RANK", "?")
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "EPL_LAUNCHER", "GROUP_RANK")
mode = os.environ.get("TEST_MODE", "ok")
child = None
if mode in ("hang", "fail", "ignore_term"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a grandchild
record = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(),
          "child": child.pid if child else None}
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
print(f"hello from rank {rank}", flush=True)
if mode == "fail" and rank == "1":
    time.sleep(0.5)
    sys.exit(3)
if mode == "kill" and rank == "1":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "peer_lost":
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == "1":
        os._exit(3)  # leaves without a word; rank 0 then fails on the lost connection
    dist.barrier()
if mode in ("hang", "fail", "ignore_term"):
    time.sleep(120)
"""

#: Data-parallel training with EPL: writes the world size and whether weights agree.
TRAIN = """
import os, sys, torch, epl
from torch import nn
env = epl.init()
with epl.replicate(device_count=1):
    model = nn.Linear(4, 1)
engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
torch.manual_seed(engine.replica_index)
engine.step(torch.randn(8, 4), torch.randn(8, 1))
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = torch.empty(weights.numel() * env.cluster.world_size)
env.communicator.all_gather(gathered, weights).wait()
same = bool((gathered.view(env.cluster.world_size, -1) == weights).all())
with open(os.path.join(os.environ["TEST_OUT"], f"train{env.cluster.rank}.txt"), "w") as f:
    f.write(f"{env.cluster.world_size} {env.cluster.launcher} {same}")
"""


def write(folder: Path) -> dict[str, Path]:
    """The scripts in ``folder``: record.py, run.sh (calls record.py) and train.py."""
    (folder / "record.py").write_text(RECORD)
    (folder / "train.py").write_text(TRAIN)
    (folder / "run.sh").write_text('#!/bin/sh\nexec python3 "$(dirname "$0")/record.py" "$@"\n')
    return {"record": folder / "record.py", "train": folder / "train.py", "run": folder / "run.sh"}
