"""Suite-wide environment: CPU DeepSpeed with a per-checkout JIT cache, and nothing from the network."""

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

# Spawned ranks inherit these. The DeepSpeed CPU comm op is JIT-built once into this cache
# (40-75 s) and reused by every later test and run of this checkout.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
