"""Run train.py's main() under torchrun and save each rank's final weights to OUTDIR/rank<N>.pt.

Usage: torchrun ... tests/save_every_rank.py OUTDIR [train.py arguments]
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

model = train.main(sys.argv[2:])
torch.save(model.state_dict(), Path(sys.argv[1]) / f"rank{os.environ['RANK']}.pt")
sys.stdout.flush()
os._exit(0)  # as train.py does: skip the C++ teardown that sometimes aborts with gloo
